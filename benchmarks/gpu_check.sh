#!/usr/bin/env bash
# Issue 24's check on an NVIDIA machine, within 10 minutes: install what is needed (wheels
# carried in $WHEELS, default benchmarks/wheels, when there are any), run the CUDA test subset,
# then benchmarks/gpu_check.py (greedy output against the CPU's exact mode, probes, decode,
# prefill and throughput beside their roofline limits). Results: $OUT/gpu_check.json (or
# ./gpu_check.json), with $OUT/log.txt, the profiles under $OUT/prof and Triton's compiled
# kernels as $OUT/triton_cache.tgz (give it back as $TRITON_CACHE_TGZ to skip compiling).
# Arguments go to gpu_check.py (e.g. --synthetic DIR, --variants float32,eager,torch). On a
# machine without CUDA it runs the same steps on the CPU (--smoke).
#
#   bash benchmarks/gpu_check.sh [gpu_check.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-benchmarks/wheels}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -n "${TRITON_CACHE_TGZ:-}" ] && [ -f "$TRITON_CACHE_TGZ" ]; then
    tar xzf "$TRITON_CACHE_TGZ" -C "$TRITON_CACHE_DIR"
fi
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl || exit 1
fi
# tokenmill from this tree; its C kernels are for CPUs and optional here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
"$PY" - <<'PY' || exit 1
import importlib, sys
missing = [m for m in ("torch", "triton", "numpy", "tokenizers", "jinja2", "gguf", "safetensors",
                       "pytest", "transformers") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing modules {missing}: put their wheels in benchmarks/wheels")
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, "
      f"CUDA available: {torch.cuda.is_available()}", flush=True)
PY
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    SMOKE=()
    PROFILE=(--profile-dir "$OUT/prof")
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)
else
    echo "gpu_check: no CUDA device; running the CPU smoke path" >&2
    SMOKE=(--smoke --device cpu)
    PROFILE=()
    XDIST=()
    export TRITON_INTERPRET=1
fi
status=0
# The CUDA path's test subset: every Triton kernel against its torch twin, the CUDA-graph
# runner's padding and buffers, and the model path end to end. On a GPU the tests run the
# compiled kernels on CUDA tensors; without one, the same tests in Triton's interpreter.
# SKIP_TESTS=1 leaves them out (a rerun on the same machine).
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
        tests/attention/test_triton_backend.py tests/attention/test_triton_e2e.py \
        tests/kernels/test_triton_kernel_backend.py tests/kernels/test_torch_int4.py \
        tests/worker/test_cuda_graph.py \
        tests/worker/test_memory.py tests/e2e/test_cuda_path.py \
        tests/engine/test_async_scheduling.py || status=1
fi
timeout "${CHECK_TIMEOUT:-300}" "$PY" benchmarks/gpu_check.py "${SMOKE[@]}" "${PROFILE[@]}" \
    --out "$OUT/gpu_check.json" "$@" || status=1
tar czf "$OUT/triton_cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
exit $status
