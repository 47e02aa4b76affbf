#!/usr/bin/env bash
# One-shot GPU suite (H100/H200, under 8 minutes): GPU-marked tests compiled (not interpreted),
# kernel benchmarks (flash, Triton and Hopper kernels, vs XLA / cuDNN / JAX's Pallas mha, and the
# dispatch's per-shape table; paged decode vs JAX's Pallas paged_attention and vs peak HBM;
# chunked prefill over a paged prefix vs contiguous), and an end-to-end bf16 decode / prefill run.
#
#   jaxgen/bench/gpu_suite.sh [OUT_DIR] [--dry-run] [--no-install] [--only=STEP,STEP...]
#
# Steps: gpu-tests, e2e, profile (one decode step's device time by category, per variant: see
# benchmarks/decode_profile.py), gpu-compile (the deviceless compile's counts: jaxgen bench
# gpu-compile), flash, paged, prefill, report. --only= runs the named ones (device and env always
# run). The studies among them (profile, flash, paged, prefill, report) run from this checkout's
# benchmarks/.
#
# OUT_DIR (default bench/results/) receives one JSON per benchmark, log.txt (every step's
# output), summary.txt (status and seconds per step) and gpu_suite.md. --dry-run runs every step at tiny sizes on the CPU (the test
# suite does this so the script cannot rot). --no-install skips `pip install -e .[cuda13]`
# (for machines that already have a CUDA JAX and no network).
set -uo pipefail
cd "$(dirname "$0")/../.."

OUT=bench/results
DRY=0
INSTALL=1
ONLY=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1; INSTALL=0 ;;
    --no-install) INSTALL=0 ;;
    --only=*) ONLY="${arg#--only=}" ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) OUT="$arg" ;;
  esac
done
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/log.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
QUICK=()
[ "$DRY" = 1 ] && QUICK=(--quick) && export JAX_PLATFORMS=cpu
FAILED=0

step() {  # step NAME SECONDS COMMAND...: runs it with a time limit, appends its output to
          # OUT/log.txt, records status and seconds in OUT/summary.txt
  local name="$1" limit="$2"; shift 2
  case "$name" in device|env|install) ;; *)
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return 0; fi ;;
  esac
  local start=$SECONDS status=ok
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  if ! timeout "$limit" "$@" > "$OUT/step.tmp" 2>&1; then status=FAILED; FAILED=1; fi
  cat "$OUT/step.tmp" >> "$OUT/log.txt"
  tail -n 4 "$OUT/step.tmp"
  rm -f "$OUT/step.tmp"
  echo "$name $status $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
}

if [ "$INSTALL" = 1 ]; then
  step install 600 "$PY" -m pip install -q -e ".[cuda13]"
fi
if [ "$DRY" = 1 ]; then
  step device 10 echo "dry run: no GPU (CPU, interpret mode, tiny sizes)"
else
  step device 30 nvidia-smi
fi
step env 30 "$PY" -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())"
# GPU_TESTS narrows the compiled kernel tests (paths under tests/) when a run is short of time.
# shellcheck disable=SC2086
step gpu-tests 240 "$PY" -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/pallas_kernels}
step e2e 240 "$PY" -m jaxgen.bench.e2e "${QUICK[@]}" --out "$OUT/e2e.json"
step profile 300 "$PY" -m benchmarks.decode_profile decode "${QUICK[@]}" --out "$OUT/profile.json"
# The same decode steps compiled deviceless for the GPU's target (a CPU process: the CUDA
# plugin's compiler, no device; jaxgen.bench.gpu_compile): the launches and temporaries that
# CI checks, beside the profile's measured ones, so a lent session sees whether they agree.
# GPU_TARGET: h200 (default) or h100. Not in --dry-run (the CPU venv has no CUDA plugin).
if [ "$DRY" != 1 ]; then
  step gpu-compile 300 env JAX_PLATFORMS=cpu "$PY" -m jaxgen.bench.gpu_compile \
    --target "${GPU_TARGET:-h200}" --programs decode --models llama3-8b,smollm2-135m \
    --batches 1,64 --out "$OUT/gpu_compile.json"
fi
# On the GPU the flash step also measures which of our prefill kernels is faster per shape and
# writes the dispatch's table (pallas_kernels/prefill_table.py, copied into OUT to commit).
TABLE=()
if [ "$DRY" != 1 ]; then TABLE=(--table); fi
step flash 200 "$PY" -m benchmarks.kernels flash "${QUICK[@]}" "${TABLE[@]}" --repeats 5 \
  --out "$OUT/flash.json"
if [ "$DRY" != 1 ]; then cp jaxgen/pallas_kernels/prefill_table.py "$OUT/" 2>/dev/null || true; fi
step paged 180 "$PY" -m benchmarks.kernels paged "${QUICK[@]}" --repeats 5 --out "$OUT/paged.json"
step prefill 120 "$PY" -m benchmarks.kernels prefill "${QUICK[@]}" --repeats 5 \
  --out "$OUT/prefill.json"
step report 30 "$PY" -m benchmarks.gpu_report "$OUT"
echo "results in $OUT (summary.txt, gpu_suite.md)"
exit $FAILED
