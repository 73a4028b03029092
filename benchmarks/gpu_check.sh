#!/usr/bin/env bash
# Issue 24's check on an NVIDIA machine, within 10 minutes: install what is needed (wheels
# carried in $WHEELS, default benchmarks/wheels, when there are any), run the CUDA test subset,
# then benchmarks/gpu_check.py (greedy output against the CPU's exact mode, probes, decode,
# prefill and throughput beside their roofline limits). Results: $OUT/gpu_check.json (or
# ./gpu_check.json). On a machine without CUDA it runs the same steps on the CPU (--smoke).
#
#   bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-benchmarks/wheels}
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$WHEELS"/*.whl || exit 1
fi
# tokenmill from this tree; its C kernels are for CPUs and optional here.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PY' || exit 1
import importlib, sys
missing = [m for m in ("torch", "triton", "numpy", "tokenizers", "jinja2", "gguf", "safetensors",
                       "pytest", "transformers") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: missing modules {missing}: put their wheels in benchmarks/wheels")
import torch
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}", flush=True)
PY
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    SMOKE=()
    MODEL=${MODEL:-gemma-3-270m}
else
    echo "gpu_check: no CUDA device; running the CPU smoke path" >&2
    SMOKE=(--smoke --device cpu)
    MODEL=${MODEL:-gemma-3-270m}
fi
status=0
# The CUDA path's test subset: every Triton kernel against its torch twin, the CUDA-graph
# runner's padding and buffers, and the model path end to end. These tests build CPU tensors,
# so they run in Triton's interpreter here too; the kernels compiled for this GPU are checked by
# gpu_check.py below, whose greedy output must agree with the CPU's exact mode.
TRITON_INTERPRET=1 timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/attention/test_triton_backend.py tests/attention/test_triton_e2e.py \
    tests/kernels/test_triton_kernel_backend.py tests/worker/test_cuda_graph.py \
    tests/worker/test_memory.py tests/e2e/test_cuda_path.py || status=1
timeout 300 "$PY" benchmarks/gpu_check.py --model "$MODEL" "${SMOKE[@]}" \
    --out "$OUT/gpu_check.json" || status=1
exit $status
