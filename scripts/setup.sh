#!/usr/bin/env bash
# Set up everything `make demo`, `make test` and `make bench` need, on a fresh machine or an old one:
#   1. .venv (python3 >= 3.10), created if missing;
#   2. the Debian libraries the Mooncake TransferEngine wheel links against (libibverbs1, libnuma1,
#      libcurl4), installed with apt only when one is missing (needs root, or prints the sudo command);
#   3. the project (editable) with its extras, and NIXL; skipped while .venv/.aiotransfer-stamp is newer
#      than pyproject.toml and this script.
# Idempotent; takes well under a second when everything is already in place.
set -euo pipefail

cd "$(dirname "$0")/.."

VENV=.venv
STAMP="$VENV/.aiotransfer-stamp"
EXTRAS="mooncake-cpu,test,bench,docs,dev"

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. virtualenv ---------------------------------------------------------------------------------
py_ok() { # $1 = interpreter; true when it runs and is >= 3.10
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1
}

new_venv=0
if [ -L "$VENV/bin/python" ] && [ ! -e "$VENV/bin/python" ]; then
    # The interpreter it was made from is gone: nothing in it can run, so start over.
    say "$VENV points to a Python that no longer exists; recreating it"
    rm -rf "$VENV"
fi
if [ -e "$VENV/bin/python" ]; then
    py_ok "$VENV/bin/python" \
        || die "$VENV/bin/python does not run or is older than 3.10; remove $VENV and re-run scripts/setup.sh"
else
    PYTHON="${PYTHON:-python3}"
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found; install Python >= 3.10 (or set PYTHON=...)"
    py_ok "$PYTHON" || die "$PYTHON is $("$PYTHON" -V 2>&1); aiotransfer needs Python >= 3.10 (set PYTHON=...)"
    say "creating $VENV with $("$PYTHON" -V 2>&1)"
    "$PYTHON" -m venv --clear "$VENV"
    new_venv=1
fi

# --- 2. Debian libraries for mooncake's engine.so ------------------------------------------------------
source "$(dirname "${BASH_SOURCE[0]}")/debian-libs.sh"
ensure_debian_libs

# --- 3. pip packages -------------------------------------------------------------------------------
if [ "$new_venv" -eq 0 ] && [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/setup.sh ]; then
    : # up to date
else
    rm -f "$STAMP"
    # pip -q, minus the warnings about extra-index-url locations that don't exist on this machine.
    pip_install() {
        "$VENV/bin/python" -m pip install -q "$@" \
            2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
    }
    if [ "$new_venv" -eq 1 ]; then
        pip_install --upgrade pip
    fi
    say "installing aiotransfer (editable) with extras [$EXTRAS]"
    pip_install -e ".[$EXTRAS]"
    # NIXL: --no-deps because nixl-cu12 requires an unpinned `torch`, which would pull a ~5 GB CUDA
    # build of torch; the CPU torch==2.13.0 from the [test] extra above is all it needs here.
    say "installing nixl-cu12 (--no-deps)"
    pip_install --no-deps "nixl-cu12>=1.5"
    touch "$STAMP"
fi

# --- 4. check ----------------------------------------------------------------------------------------
if ! err="$("$VENV/bin/python" -c 'import mooncake.engine' 2>&1)"; then
    rm -f "$STAMP" # retry the install next time
    say "ERROR: 'import mooncake.engine' fails in $VENV:"
    printf '%s\n' "$err" | tail -n 5 >&2
    die "Mooncake TransferEngine is unusable; check the Debian libraries above (ldd $VENV/lib/python3*/site-packages/mooncake/engine.so) and re-run scripts/setup.sh"
fi
