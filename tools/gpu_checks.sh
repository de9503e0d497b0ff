#!/usr/bin/env bash
# Every GPU check of the project in one run, most important first (a device call is
# precious): the GPU tests, the reference model on CUDA with and without the passes,
# the GEMM benchmark, the SP gather benchmark (needs 2 GPUs), the SP demo over NCCL.
# Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
python3 -m mxfuse demo --device cuda --config m3-flash-tp4 --tokens 1024 --steps 10 2>&1 | tee "$OUT/demo_m3_1024.log"
python3 -m mxfuse demo --device cuda --config m3-flash-tp4 --tokens 16 --steps 10 2>&1 | tee "$OUT/demo_m3_16.log"
python3 tools/bench_gemm.py --out "$OUT" 2>&1 | tail -45 | tee "$OUT/bench_gemm.log"
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -ge 2 ]; then
  python3 tools/bench_sp.py --world "$GPUS" --out "$OUT" 2>&1 | tee "$OUT/bench_sp.log"
  python3 -m mxfuse demo --sp "$GPUS" --device cuda --tokens 256 --steps 5 2>&1 | tee "$OUT/demo_sp$GPUS.log"
fi
