#!/usr/bin/env bash
# What `make test-gpu` and `python -m benchmarks device` need on a CUDA 13 GPU host that has Python 3.12 and torch
# but no package index: packed on a machine with one, copied over, installed there without a network.
#
#   bash scripts/gpu-carry.sh pack          # here: .gpu-carry/ (about 45 MB)
#   source scripts/gpu-carry.sh install     # there, from the repository root: sets PYTHONPATH, LD_LIBRARY_PATH
#
# `pack` downloads the wheels (the engines: nixl-cu13 and mooncake-transfer-engine-cuda13; pyzmq, msgspec,
# pytest-asyncio), leaves out the parts aiotransfer never loads (NIXL's expert-parallel kernels, Mooncake's
# store, master, process group and EP builds, UCX's perftest), and compresses the rest into one xz file.
# It also downloads the Debian libraries Mooncake's engine.so links (libibverbs, libmlx5, libnuma, libcurl and
# what libcurl needs). `install` unpacks the wheels into /tmp/aiotransfer-site and resolves each library
# engine.so cannot find: from the Debian packages (copied alone into /tmp/aiotransfer-libs, so that nothing
# else of theirs shadows the host's) or from the CUDA runtime that torch brought.
[[ "${BASH_SOURCE[0]}" == "$0" ]] && set -euo pipefail

_GPU_CARRY_DIR=".gpu-carry"
_GPU_WHEELS=(pyzmq msgspec pytest-asyncio nixl-cu13==1.5.1 mooncake-transfer-engine-cuda13==0.3.14)
_GPU_DEBS=(libibverbs1 ibverbs-providers libnuma1 libnl-3-200 libnl-route-3-200 libcurl4 libbrotli1
    libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libidn2-0 libunistring2
    libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3 libnghttp2-14 libpsl5 librtmp1 libgnutls30
    libhogweed6 libnettle8 libgmp10 libp11-kit0 libffi8 libtasn1-6 libssh2-1 libssl3 libzstd1 zlib1g)
_GPU_PRUNE=(nixl_ep_cu13 'mooncake/_store*.so' mooncake/mooncake_client mooncake/mooncake_master
    'mooncake/libmooncake_pg*.so' mooncake/transfer_engine_bench 'mooncake/_ep*.so'
    mooncake/libmooncake_ep_device.so mooncake/_pg_jit mooncake/mooncake_ep_jit
    'nixl_cu13.libs/ucx/libucx_perftest*')

gpu_carry_pack() {
    local python="${PYTHON:-python3}" work
    [[ "$python" == */* ]] && python="$(realpath "$python")"
    work="$(mktemp -d)"
    rm -rf "$_GPU_CARRY_DIR" && mkdir -p "$_GPU_CARRY_DIR/debs" "$work/wheels" "$work/site"
    local platforms=()
    for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_26 \
            manylinux_2_17 manylinux2014 manylinux1; do
        platforms+=(--platform "${p}_x86_64")
    done
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" --platform any -d "$work/wheels" "${_GPU_WHEELS[@]}"
    for w in "$work"/wheels/*.whl; do
        (cd "$work/site" && "$python" -m zipfile -e "$w" .)
    done
    (cd "$work/site" && for pat in "${_GPU_PRUNE[@]}"; do eval rm -rf "$pat"; done)
    tar -C "$work/site" -cf - . | xz -9 -T0 > "$_GPU_CARRY_DIR/site.tar.xz"
    (cd "$_GPU_CARRY_DIR/debs" && apt-get download "${_GPU_DEBS[@]}" >/dev/null)
    rm -rf "$work"
    du -sh "$_GPU_CARRY_DIR"
}

_gpu_missing() {  # sonames a library cannot resolve with the current LD_LIBRARY_PATH
    ldd "$1" 2>/dev/null | awk '/=> not found/ {print $1}'
}

gpu_carry_install() {
    local site=/tmp/aiotransfer-site libs=/tmp/aiotransfer-libs debs=/tmp/aiotransfer-debs python="${PYTHON:-python3}"
    mkdir -p "$site" "$libs" "$debs"
    xz -dc "$_GPU_CARRY_DIR/site.tar.xz" | tar -x -C "$site"
    for deb in "$_GPU_CARRY_DIR"/debs/*.deb; do
        dpkg -x "$deb" "$debs" 2>/dev/null || (cd "$debs" && ar p "$deb" data.tar.xz | tar -xJ)
    done
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    local cuda_dirs
    cuda_dirs="$("$python" - <<'EOF'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = {os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libcudart.so*"), recursive=True)}
dirs |= {d for d in ("/usr/local/cuda/lib64", "/usr/local/nvidia/lib64") if os.path.isdir(d)}
print(":".join(sorted(dirs)))
EOF
)"
    export LD_LIBRARY_PATH="$libs${cuda_dirs:+:$cuda_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    local lib found round
    for round in 1 2 3 4 5 6; do
        local missing=()
        for so in "$site"/mooncake/engine.so "$libs"/*.so*; do
            [ -e "$so" ] || continue
            while read -r lib; do missing+=("$lib"); done < <(_gpu_missing "$so")
        done
        [ "${#missing[@]}" -eq 0 ] && break
        local copied=0
        for lib in $(printf '%s\n' "${missing[@]}" | sort -u); do
            found="$(find "$debs" -name "$lib" | head -1)"
            if [ -n "$found" ]; then
                cp -L "$found" "$libs/$lib" && copied=1
            elif [ "$round" -eq 1 ]; then
                echo "gpu-carry: $lib: not in the carried Debian packages" >&2
            fi
        done
        [ "$copied" -eq 1 ] || break
    done
    echo "gpu-carry: installed into $site; libraries added: $(ls "$libs" | tr '\n' ' ')"
}

case "${1:-}" in
    pack) gpu_carry_pack ;;
    install) gpu_carry_install ;;
    *) echo "usage: bash scripts/gpu-carry.sh pack | source scripts/gpu-carry.sh install" >&2 ;;
esac
