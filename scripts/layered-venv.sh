# Sourced by scripts/interop-venv.sh and scripts/vllm-venv.sh: the two layers both build.
# The caller defines `say`, `die`, `pip_q` and PYTHON, CACHE, BASE, BASE_STAMP, RECIPE_ID, CHECK, ROOT,
# VENV, STAMP.

# base_valid: the base venv exists, was built from this recipe, and its quick check passes.
base_valid() {
    [ -f "$BASE_STAMP" ] && [ "$(head -n1 "$BASE_STAMP")" = "$RECIPE_ID" ] \
        && "$BASE/bin/python" -c "$CHECK" >/dev/null 2>&1
}

# base_create WHAT SIZE: a fresh base venv with an up-to-date pip. Sets BPIP (its quiet `pip install`)
# and LINKS: torch comes only as the CPU wheel, which lies in /opt/wheels here (pip's find-links); it is
# named explicitly too, in case the environment's pip settings were dropped.
base_create() {
    BASE_T0=$(date +%s)
    say "building the $1 base venv in $BASE (a few minutes; about $2)"
    rm -rf "$BASE"
    mkdir -p "$CACHE"
    "$PYTHON" -m venv --clear "$BASE"
    BPIP=("$BASE/bin/python" -m pip install -q --disable-pip-version-check --no-input)
    pip_q "${BPIP[@]}" --upgrade pip
    LINKS=()
    [ -d /opt/wheels ] && LINKS=(--find-links /opt/wheels)
    return 0
}

# base_finish FREEZE FULL_CHECK_COMMAND...: refuse CUDA wheels, run the quick and the full check, keep
# `pip freeze` in $BASE/FREEZE and write the stamp that makes the base valid.
base_finish() {
    local freeze="$1" err t1
    shift
    if "$BASE/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
        die "a CUDA dependency (nvidia-*) got into $BASE; refusing to go on"
    fi
    err="$("$BASE/bin/python" -c "$CHECK" 2>&1 && "$@" 2>&1)" \
        || { printf '%s\n' "$err" | tail -n 8 >&2; die "base venv check failed"; }
    "$BASE/bin/python" -m pip freeze 2>/dev/null >"$BASE/$freeze" || true
    t1=$(date +%s)
    printf '%s\nbuilt %s in %ss\n' "$RECIPE_ID" "$(date -u +%FT%TZ)" "$((t1 - BASE_T0))" >"$BASE_STAMP"
    say "step 4/4 done: base venv built in $((t1 - BASE_T0)) s, $(du -sh "$BASE" | cut -f1)"
}

# overlay_venv MODULE PTH: layer 2, $VENV in this checkout: a venv without pip whose site-packages holds
# PTH, a .pth that adds the base's site-packages (through site.addsitedir, so the base's own .pth files
# run too), plus this checkout's aiotransfer installed editable. Rebuilt when missing, stale (other base
# or other checkout, or pyproject.toml changed) or broken; checked by importing aiotransfer and MODULE.
overlay_venv() {
    local module="$1" pth="$2" base_site vsite
    base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if [ "$REBUILD" -eq 1 ] || ! overlay_valid "$module"; then
        say "creating $VENV on top of $BASE"
        rm -rf "$VENV"
        "$BASE/bin/python" -m venv --without-pip "$VENV"
        vsite="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        printf 'import site; site.addsitedir(%s)\n' "'$base_site'" >"$vsite/$pth"
        # aiotransfer's runtime dependencies are in the base.
        pip_q "$BASE/bin/python" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check \
            --no-input --no-deps -e "$ROOT"
        printf '%s %s\n' "$BASE" "$ROOT" >"$STAMP"
        overlay_valid "$module" || die "$VENV does not import aiotransfer from $ROOT and $module from $BASE"
    fi
}

overlay_valid() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$BASE $ROOT" ] && [ "$STAMP" -nt "$ROOT/pyproject.toml" ] \
        && [ "$("$VENV/bin/python" -c "import os, aiotransfer, importlib.util as u; assert u.find_spec('$1'); print(os.path.dirname(os.path.dirname(os.path.realpath(aiotransfer.__file__))))" 2>/dev/null)" = "$ROOT" ]
}
