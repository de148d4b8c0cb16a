#!/usr/bin/env bash
# The GPU checks of the Triton kernels and the CUDA capture path, in one go on a CUDA machine:
#   1. the Triton bit-exactness tests, compiled for the GPU (TRITON_INTERPRET=0);
#   2. bench_quant: achieved bandwidth of every default format, Triton and torch backends;
#   3. bench_stats: the fused statistics pass vs the torch statistics vs clone;
#   4. bench_emulation on CUDA: emulated / unemulated step time (tiny Llama and a 4096 linear);
#   5. the collector: a real captured + mxfp8-emulated training run of the tiny Llama on CUDA;
#   6. Transformer Engine (when it imports): Linear / LayerNormLinear under our factory against
#      our emulation (output, dgrad, bias gradient, fused main_grad), bench/te_gpu_check.py.
# Usage: bash bench/gpu_check.sh [LOG_DIR]   (megatron-core must be importable)
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-gpu_check_logs}
mkdir -p "$LOG"
PY=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
step() { echo; echo "=== $1 ($(date +%T))"; }
step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step "1. Triton tests on CUDA"
"$PY" -m pytest -q -p no:cacheprovider -n 8 tests/test_quant_triton.py \
    tests/test_capture_stats_kernel.py 2>&1 | tail -15 | tee "$LOG/tests.txt"
step "2. bench_quant 8192x8192 bf16"
for b in triton torch; do
  "$PY" bench/bench_quant.py --device cuda --dtype bfloat16 --rows 8192 --cols 8192 \
      --backend $b --repeats 5 2>&1 | tee "$LOG/bench_quant_$b.txt"
done
step "3. bench_stats"
"$PY" bench/bench_stats.py --device cuda 2>&1 | tee "$LOG/bench_stats.txt"
step "4. bench_emulation on CUDA"
"$PY" bench/bench_emulation.py --device cuda --rounds 4 2>&1 | grep -v Warning \
    | grep -v warnings.warn | tee "$LOG/bench_emulation.txt"
step "5. collector: captured + emulated tiny Llama on CUDA"
"$PY" -m training_driver.collector --quant-type mxfp8 --tensor-dir /tmp/gpu_caps \
    --workdir /tmp/gpu_work --no-visualize 2>&1 | grep -v Warning | grep -v warnings.warn \
    | tail -40 | tee "$LOG/collector.txt"
"$PY" - <<'PY' 2>&1 | tee -a "$LOG/collector.txt"
import glob, json, os
files = sorted(glob.glob("/tmp/gpu_caps/**/*.pt", recursive=True))
print(len(files), "tensor files,", sum(os.path.getsize(f) for f in files) // 1024, "KiB")
metas = sorted(glob.glob("/tmp/gpu_caps/**/*.json*", recursive=True))
print(len(metas), "metadata/manifest files")
for f in files[:3]:
    print(" ", os.path.basename(f))
PY
step "6. Transformer Engine under our quantizer factory"
if "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  for f in mxfp8 nvfp4; do "$PY" bench/te_gpu_check.py --fmt $f 2>&1 | tee -a "$LOG/te.txt"; done
else
  echo "Transformer Engine does not import: skipped" | tee "$LOG/te.txt"
fi
step "done"
