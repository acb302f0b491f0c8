#!/usr/bin/env bash
# One call on a GPU machine: environment, the GPU test suite, the demo, and
# optional extra steps. Logs go to $OUT (or ./.gpuout).
# Usage: bash scripts/device_check.sh [step ...]
#   steps: precompile, tests, demo (the default), features, families, fuzz, quick, asv, mla,
#          bench-float32, bench-tf32, decode, first-call, train, sanitize, ncu (Nsight Compute on
#          the first launch of NCU_KERNEL, a regex, in quick_bench's case NCU_CASE: stall
#          reasons, tensor pipe use), ncu-source (the same with stall samples per SASS
#          instruction, to $OUT/ncu-source-sass.csv; NCU_ARGS: quick_bench's options), forward-tma (the copy engine's
#          forward: its GPU tests, forward timings with and without it, host time), backward-ws
#          (the warp-specialized backward: its copy engine's GPU tests, timings
#          against backward_wgmma and cuDNN, and without the copy engine), backward-256 (its
#          256 class: the copy engine's and the value head dim's GPU tests, timings against
#          backward_wgmma and cuDNN, the MLA training shape), costs (the model-shape features against their targets),
#          forward-64 (the 64 class's forwards: their GPU tests, the default against
#          forward_wgmma_ws and forward_wgmma one process a row, and cuDNN),
#          persistent (the warp-specialized kernels' persistent roles: their GPU tests,
#          every plain call persistent through the copy-engine tests, forward and
#          backward timings with them forced on and off around the forward's line, cuDNN),
#          context-memory (each context-parallel mode's memory a rank on virtual ranks),
#          mla-wgmma (absorbed MLA's decode kernels: their GPU tests, both kernels' timings,
#          Nsight Compute on kvcache_decode_mla_wgmma in MLA_CASE, "B H L"), fp8 (the FP8
#          forward's GPU tests, two against three consumers beside cuDNN's FP8 (carry
#          nvidia-cudnn-frontend's wheel in .whl/), the sanitizer on its dense calls)
# "tests" takes TEST_FILES (default: tests) for a part of the suite.
# "tests" and "features" run under xdist (-n ${WORKERS:-8}) with a line a test (-rA), so a
# log cut short by its limit still names every test that failed before the cut.
# "families" runs tests/test_kernel_families.py in its own process (a kernel fault
# there cannot spoil the rest of the suite); "tests" then leaves that file out.
# Wheels carried in .whl/ (e.g. asv, which the GPU image lacks) are installed first.
set -u
OUT=${OUT:-.gpuout}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${*:-precompile tests demo}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/env.txt"
python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())" | tee -a "$OUT/env.txt"
run() {  # run NAME SECONDS COMMAND...: log to $OUT/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - start)) s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
  grep -E "(FAILED|ERROR) tests/" "$OUT/$name.log" | sed 's/ - .*//' | sort -u | head -n 40
}
for step in $steps; do
  case $step in
    precompile) TAIL=2 run precompile 120 python3 -m cuflash.precompile --head-dims 8,40,64,96,128,256 ;;
    families) TAIL=30 run gpu-families ${FAMILIES_LIMIT:-200} python3 -m pytest -m gpu -q -rf \
               -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} tests/test_kernel_families.py ;;
    tests) CUFLASH_GPU_FUZZ_EXAMPLES=${FUZZ:-40} TAIL=20 run gpu-tests ${TESTS_LIMIT:-450} \
             python3 -m pytest -m gpu -v -rf -p no:cacheprovider -n ${WORKERS:-8} --timeout 150 \
             ${PYTEST_K:+-k "$PYTEST_K"} --ignore=tests/test_kernel_families.py ${TEST_FILES:-tests} ;;
    features) TAIL=20 run gpu-features ${FEATURES_LIMIT:-240} python3 -m pytest -m gpu -v -rf \
             -p no:cacheprovider -n ${WORKERS:-8} --timeout 150 tests/test_head_dim_v.py \
             tests/test_kvcache_head_dim_v.py \
             tests/test_rotary.py tests/test_fp8.py tests/test_sinks.py tests/test_kvcache.py ;;
    costs) TAIL=30 run costs 120 bash -c "python3 scripts/feature_costs.py && \
             python3 -m cuflash.bench --head-dim-v --no-first-call --no-memory --time-budget 30" ;;
    mla) TAIL=20 run mla-decode 150 python3 -m cuflash.bench --mla-decode --no-first-call \
           --no-memory --time-budget 40 --json "$OUT/h200-mla-decode.json" ;;
    mla-wgmma) TAIL=60 run mla-wgmma 300 bash -c "python3 -m pytest -m gpu -q -rf \
             -p no:cacheprovider -n ${WORKERS:-8} tests/test_kvcache_head_dim_v.py && \
             python3 scripts/mla_variants.py --wgmma | grep -v '^cuflash.bench' && \
             ncu --kernel-name regex:kvcache_decode_mla_wgmma --launch-skip 1 --launch-count 1 \
             --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
             --metrics sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active \
             python3 scripts/mla_variants.py --once ${MLA_CASE:-32 128 4096}" ;;
    fp8) TAIL=60 run fp8 480 bash -c "python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
             -n ${WORKERS:-8} --timeout 120 tests/test_fp8_kernel.py tests/test_fp8.py && \
             python3 scripts/fp8_variants.py | grep -v '^cuflash.bench' && \
             SANITIZE_SETTINGS=fp8 bash scripts/sanitize.sh memcheck racecheck synccheck" ;;
    demo) run demo 60 python3 -m cuflash ;;
    context-memory) TAIL=12 run context-memory 300 bash -c "python3 scripts/context_memory.py \
             --device gpu --seq-len 65536 --ranks 2 && python3 scripts/context_memory.py \
             --device gpu --seq-len 65536 --ranks 4 --ulysses-size 2" ;;
    fuzz) CUFLASH_GPU_FUZZ_EXAMPLES=${FUZZ_EXAMPLES:-1000} TAIL=8 run gpu-fuzz ${FUZZ_LIMIT:-400} \
            python3 -m pytest -m gpu -q -p no:cacheprovider -k gpu_fuzz tests/test_fuzz.py ;;
    quick) TAIL=40 run quick-bench 300 bash -c "python3 scripts/quick_bench.py ${QUICK_CASES:-} && \
             python3 scripts/quick_bench.py --float32 ${QUICK_CASES_32:-64,4096,0 128,4096,0 128,1024,1}" ;;
    asv) python3 -m asv machine --yes > /dev/null 2>&1
         CUFLASH_ASV_GRID=small ASV_PYTHONPATH=$PWD TAIL=24 run asv 150 python3 -m asv run \
           --python=same --quick --dry-run --launch-method spawn -b "track_(forward|backward)_tflops" ;;
    bench-float32) TAIL=30 run bench-float32 150 python3 -m cuflash.bench --dtype float32 \
           --head-dims 64,128 --seqlens 1024,4096 --no-first-call --no-memory --time-budget 90 \
           --json "$OUT/h200-float32.json" ;;
    bench-tf32) TAIL=30 run bench-tf32 150 python3 -m cuflash.bench --dtype float32 --allow-tf32 \
           --head-dims 64,128 --seqlens 1024,4096 --no-first-call --no-memory --time-budget 90 \
           --json "$OUT/h200-tf32.json" ;;
    decode) TAIL=24 run decode 200 python3 -m cuflash.bench --decode --no-first-call --no-memory \
           --json "$OUT/h200-decode.json" ;;
    first-call) TAIL=10 run first-call 90 python3 -m cuflash.bench --dtype bfloat16 --head-dims 128 \
           --seqlens 1024 --no-torch --no-memory --time-budget 30 ;;
    train) TAIL=15 run train 240 python3 examples/train_tiny_lm.py --device gpu --plot "$OUT/loss.png" \
           --require-target ;;
    sanitize) TAIL=30 run sanitize ${SANITIZE_LIMIT:-400} bash scripts/sanitize.sh ;;
    ncu) TAIL=60 run ncu 240 ncu --kernel-name "regex:${NCU_KERNEL:-forward_wgmma}" \
           --launch-count 1 --section SpeedOfLight --section SchedulerStats \
           --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum" \
           python3 scripts/quick_bench.py ${NCU_CASE:-64,4096,0} ;;
    ncu-source) run ncu-source 300 ncu --kernel-name "regex:${NCU_KERNEL:-forward_wgmma_ws}" \
           --launch-count 1 --clock-control none --section SpeedOfLight --section WarpStateStats \
           --section SourceCounters -f -o "$OUT/ncu-source" \
           python3 scripts/quick_bench.py ${NCU_ARGS:---forward --rows=auto} ${NCU_CASE:-128,4096,0}
         # stall samples per SASS instruction, for reading here (NCU_KERNEL's first launch)
         ncu -i "$OUT/ncu-source.ncu-rep" --page source --csv --print-source sass \
           > "$OUT/ncu-source-sass.csv" 2>&1
         ncu -i "$OUT/ncu-source.ncu-rep" --page details > "$OUT/ncu-source-details.txt" 2>&1
         tail -n 40 "$OUT/ncu-source-details.txt" ;;
    forward-tma) TAIL=30 run forward-tma 300 bash -c "python3 -m pytest -m gpu -q -rf \
             -p no:cacheprovider -n ${WORKERS:-8} tests/test_tma_forward.py && \
             python3 scripts/quick_bench.py --forward --rows=auto,cudnn ${QUICK_CASES:-} && \
             CUFLASH_TMA=0 python3 scripts/quick_bench.py --forward --rows=auto ${QUICK_CASES:-} \
             && python3 scripts/forward_host_time.py && \
             CUFLASH_TMA=0 python3 scripts/forward_host_time.py" ;;
    backward-ws) TAIL=30 run backward-ws 300 bash -c "python3 -m pytest -m gpu -q -rf \
             -p no:cacheprovider -n ${WORKERS:-8} tests/test_tma_backward.py && \
             python3 scripts/quick_bench.py --rows=auto,wgmma,det,wgmma-det,cudnn ${QUICK_CASES:-} && \
             CUFLASH_TMA=0 python3 scripts/quick_bench.py --rows=auto,det ${QUICK_CASES:-}" ;;
    backward-256) TAIL=40 run backward-256 420 bash -c "python3 -m pytest -m gpu -q -rf \
             -p no:cacheprovider -n ${WORKERS:-8} tests/test_tma_backward.py tests/test_head_dim_v.py && \
             python3 scripts/quick_bench.py --rows=auto,wgmma,det,wgmma-det,cudnn \
             ${QUICK_CASES:-256,4096,0 256,4096,1 256,1024,1 192,4096,1 192,1024,0 160,4096,0 224,4096,0 136,4096,1 256,16384,1} && \
             python3 -m cuflash.bench --head-dim-v --no-first-call --no-memory" ;;
    forward-64) TAIL=30 run forward-64 300 bash -c "python3 -m pytest -m gpu -q -rf \
             -p no:cacheprovider -n ${WORKERS:-8} tests/test_kernel_families.py \
             -k 'three_consumer or dispatch_follows or without_warp' && \
             for r in auto ws-fwd sync cudnn; do python3 scripts/quick_bench.py --forward \
             --rows=\$r ${QUICK_CASES:-64,4096,0 64,1024,0 64,1024,1 64,2048,1 32,4096,0}; done" ;;
    persistent) TAIL=40 run persistent 360 bash -c "python3 -m pytest -m gpu -q -rf \
             -p no:cacheprovider -n ${WORKERS:-8} tests/test_kernel_families.py -k persistent && \
             CUFLASH_PERSISTENT=1 python3 -m pytest -m gpu -q -rf -p no:cacheprovider \
             -n ${WORKERS:-8} tests/test_tma_forward.py tests/test_tma_backward.py && \
             for p in 1 0; do CUFLASH_PERSISTENT=\$p python3 scripts/quick_bench.py \
             --rows=ws-fwd ${QUICK_CASES:-64,2048,0 128,2048,0 128,2048,1 128,3072,1 128,4096,1 96,1024,1 256,1024,1}; \
             done; python3 scripts/quick_bench.py --rows=cudnn \
             ${QUICK_CASES:-64,2048,0 128,2048,0 128,2048,1 128,3072,1 128,4096,1 96,1024,1 256,1024,1}" ;;
    *) echo "unknown step $step" ;;
  esac
done
