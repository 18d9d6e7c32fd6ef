# Sourced by scripts/setup.sh, scripts/interop-venv.sh and scripts/vllm-venv.sh (which define `say`).
# ensure_debian_libs: install the Debian libraries mooncake's engine.so links against, when missing.
ensure_debian_libs() {
    # Read the linker cache once: `ldconfig -p | grep -q` under pipefail can fail spuriously (SIGPIPE).
    local ldconfig ld_cache pair lib pkg
    local -a missing=()
    ldconfig="$(command -v ldconfig || echo /sbin/ldconfig)"
    ld_cache="$("$ldconfig" -p 2>/dev/null || true)"
    for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
        lib="${pair%%:*}" pkg="${pair##*:}"
        grep -qF "$lib " <<<"$ld_cache" || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        say "missing Debian packages: ${missing[*]}. Install them with:"
        printf '    sudo apt-get update && sudo apt-get install -y %s\n' "${missing[*]}" >&2
        exit 1
    fi
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
}
