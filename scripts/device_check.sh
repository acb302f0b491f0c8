#!/usr/bin/env bash
# One call on a GPU machine: environment, the GPU test suite, the demo, and
# (with --bench) the comparison benchmark. Logs go to $OUT (or ./.gpuout).
# Usage: bash scripts/device_check.sh [pytest -k expression] [--bench ARGS...]
set -u
OUT=${OUT:-.gpuout}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/env.txt"
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())" | tee -a "$OUT/env.txt"
KEXPR=${1:-}
set -o pipefail
python3 -m pytest -m gpu -q -p no:cacheprovider ${KEXPR:+-k "$KEXPR"} tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -n 40
python3 -m cuflash 2>&1 | tee "$OUT/demo.log"
