#!/usr/bin/env bash
# The GPU checks in one go, on a CUDA host prepared by `scripts/gpu-carry.sh` (or with the packages
# installed): the versions, the tests marked `gpu` (`make test-gpu`) and `python -m benchmarks device`.
# Logs and the bench's JSON go to $OUT (default ./gpu-check). Each step has its own time limit, and a
# failing step does not stop the next.
#
#   bash scripts/gpu-check.sh [pytest args...]
set -uo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL="${MC_LOG_LEVEL:-WARNING}"
if [ -f .gpu-carry/site.tar.xz ]; then
    # shellcheck source=/dev/null
    source scripts/gpu-carry.sh install > >(tee "$OUT/install.log") 2>&1
fi
python3 - <<'PY' 2>&1 | tee "$OUT/versions.log"
import importlib, importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory >> 30, "GiB")
else:
    print("no CUDA device visible to torch")
for dist in ("nixl-cu13", "mooncake-transfer-engine-cuda13", "pyzmq", "msgspec", "pytest-asyncio"):
    try:
        print(dist, md.version(dist))
    except md.PackageNotFoundError:
        print(dist, "missing")
for mod in ("mooncake.engine", "nixl_cu13._api", "aiotransfer"):
    try:
        importlib.import_module(mod)
        print("import", mod, "ok")
    except Exception as exc:  # noqa: BLE001 -- reported, the next steps say what it breaks
        print("import", mod, "FAILED:", type(exc).__name__, exc)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/versions.log"
timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -s -p no:cacheprovider -rA --timeout 150 \
    tests/test_gpu.py "$@" 2>&1 | tee "$OUT/test-gpu.log"
echo "test-gpu exit: ${PIPESTATUS[0]}" | tee -a "$OUT/test-gpu.log"
timeout "${GPU_BENCH_TIMEOUT:-240}" python3 -m benchmarks device --out "$OUT/device.json" 2>&1 \
    | tee "$OUT/bench-device.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench-device.log"
