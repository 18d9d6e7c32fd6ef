#!/usr/bin/env bash
# Build the SGLang interop environment: .interop-venv, a Python that can import SGLang 0.5.23 (CPU torch,
# Mooncake over TCP) *and* aiotransfer, so tests/interop/ can run unmodified SGLang classes beside ours.
#
# Two layers, so a machine builds the heavy part once even though CI works in a fresh clone every run:
#   1. the SGLang base venv (~2 GB: torch CPU, sglang, transformers, mooncake, ...), built once per machine
#      and recipe in $AIOTRANSFER_INTEROP_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/aiotransfer), named
#      after a hash of the recipe below; valid while its stamp holds that hash and its key imports work;
#   2. .interop-venv in this checkout: a small venv (no pip of its own) whose site-packages holds a .pth
#      that adds the base venv's site-packages, plus this checkout's aiotransfer installed editable.
#      Rebuilt in seconds when missing, stale (other base or other checkout) or broken.
#
# Usage: scripts/interop-venv.sh [--rebuild]     (--rebuild: rebuild both layers from scratch)
# Prints the path of .interop-venv/bin/python on stdout; everything else goes to stderr.
# Non-interactive (no stdin needed); as root it installs the Debian libraries Mooncake needs.
# torch comes from the CPU wheel on local disk (pip config find-links /opt/wheels): the plain PyPI
# `torch==2.13.0` is a multi-GB CUDA build, so this script refuses to install anything but `+cpu`.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd -P)"

say() { printf '[interop-venv] %s\n' "$*" >&2; }
die() { printf '[interop-venv] ERROR: %s\n' "$*" >&2; exit 1; }

REBUILD=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) REBUILD=1 ;;
        -h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
        *) die "unknown argument: $arg" ;;
    esac
done

# --- the recipe (verified on a CPU-only machine; see docs/sglang-wire.md) -----------------------------
PYTHON="${PYTHON:-python3}"
STEP1=("torch==2.13.0+cpu" "mooncake-transfer-engine-non-cuda==0.3.13.post1" numpy pyzmq aiohttp requests)
STEP2=("sglang==0.5.23" "triton==3.6.0" "compressed-tensors==0.18.0") # --no-deps
STEP3=(orjson psutil pybase64 packaging pillow starlette python-multipart msgspec pydantic tqdm
       prometheus_client dill loguru gguf "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11"
       "transformers==5.19.0" anyio)
# Quick validity check of the base venv (under a second: sglang itself is only located, not imported).
CHECK='import torch, mooncake.engine, zmq, aiohttp, msgspec, anyio, numpy, importlib.util as u
import importlib.metadata as md
assert torch.__version__.endswith("+cpu"), torch.__version__
assert u.find_spec("sglang") is not None and md.version("sglang") == "0.5.23", "sglang 0.5.23 missing"'
# Full check after a build: SGLang's Mooncake disaggregation module imports (with our stubs, ~7 s).
FULL_CHECK='import sglang.srt.disaggregation.mooncake.conn, sglang.srt.server_args'
STUBS="$ROOT/benchmarks/sglang/stubs"

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=...)"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
RECIPE_ID="$(printf '%s\n' "$PYVER" "${STEP1[*]}" "${STEP2[*]}" "${STEP3[*]}" | sha256sum | cut -c1-12)"
CACHE="${AIOTRANSFER_INTEROP_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aiotransfer}"
BASE="$CACHE/sglang-0.5.23-py$PYVER-$RECIPE_ID"
BASE_STAMP="$BASE/.interop-base-stamp"
VENV="$ROOT/.interop-venv"
STAMP="$VENV/.interop-stamp"

pip_q() { # pip, quiet, minus the warnings about extra-index-url folders that don't exist here
    # and minus the resolver's list of SGLang requirements that step 2 leaves out on purpose (--no-deps).
    "$@" 2> >(grep -v -e 'is ignored: it is neither a file nor a directory' \
                      -e 'dependency resolver does not currently take into account' \
                      -e '^sglang [0-9.]* requires ' >&2)
}

# --- Debian libraries for mooncake's engine.so ------------------------------------------------------------
source "$(dirname "${BASH_SOURCE[0]}")/debian-libs.sh"
ensure_debian_libs

# --- 1. the SGLang base venv (once per machine and recipe) ---------------------------------------------
source "$(dirname "${BASH_SOURCE[0]}")/layered-venv.sh"

if [ "$REBUILD" -eq 1 ] || ! base_valid; then
    base_create SGLang "2 GB"
    say "step 1/4: ${STEP1[*]}"
    pip_q "${BPIP[@]}" "${LINKS[@]}" "${STEP1[@]}" \
        || die "step 1 failed (torch==2.13.0+cpu must come from a local CPU wheel, e.g. /opt/wheels)"
    say "step 2/4: --no-deps ${STEP2[*]}"
    pip_q "${BPIP[@]}" --no-deps "${STEP2[@]}"
    say "step 3/4: SGLang's runtime dependencies"
    pip_q "${BPIP[@]}" "${LINKS[@]}" "${STEP3[@]}"
    base_finish .interop-freeze.txt env PYTHONPATH="$STUBS" "$BASE/bin/python" -W ignore -c "$FULL_CHECK"
fi

# --- 2. .interop-venv in this checkout -----------------------------------------------------------------
overlay_venv sglang _interop_base.pth

echo "$VENV/bin/python"
