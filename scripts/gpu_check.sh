#!/usr/bin/env bash
# The GPU check of issue 33, prepared on the CPU and run as one command on a lent machine (docs/gpu.md):
#
#   device run:  bash scripts/gpu_check.sh            (carry .whl: the wheels scripts/gpu_wheels.sh fetched)
#   dry run:     GPU_CHECK_DEVICE=cpu bash scripts/gpu_check.sh   (the same steps, small, on this CPU)
#
# Steps, each bounded by `timeout` so the whole stays under ~8 minutes on an H200:
#   1. install the carried wheels (fastapi, uvicorn, pydantic, ...) into /tmp/site, if .whl/ is there;
#   2. the device's facts (nvidia-smi, torch) and the roofline's ceilings (scripts/gpu_peaks.py);
#   3. the `cuda` tests (tests/test_cuda.py);
#   4. the benchmark's concurrency sweep on a distilgpt2-shaped and a Llama-3.2-1B-shaped random checkpoint: ours
#      (torch runtime, fp32) beside static HF generate and transformers' continuous batching (bf16), p50/p95/p99,
#      TTFT, inter-token latency; JSON and plots.
# Everything it writes goes to $OUT (at most 8 files come back from a lent machine: the plots travel as one tar).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
say() { echo "== $(date +%T) $*" | tee -a "$LOG"; }
export PYTHONUNBUFFERED=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1

if [ "$DEVICE" != cpu ] && compgen -G ".whl/*.whl" >/dev/null; then  # cp312 wheels: the lent machine's Python
    say "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        >>"$LOG" 2>&1 || { say "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi

if [ "$DEVICE" = cpu ]; then  # dry run: small everything
    CAPS=1,2; QUICK=--quick; PEAKS="--device cpu --size 256 --copy-mib 64 --repeats 3"; SHAPES="tiny"; BUDGET=600
else
    CAPS=1,4,16,64,256; QUICK=; PEAKS=; SHAPES="distilgpt2 llama-1b"; BUDGET=150
fi

say "device facts"
{ nvidia-smi 2>&1 || true; python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; } >"$OUT/device.txt" 2>&1
timeout 120 python3 -m scripts.gpu_peaks $PEAKS --json "$OUT/peaks.json" >>"$LOG" 2>&1 || say "gpu_peaks failed (rc $?)"

say "cuda tests"
if [ "$DEVICE" = cpu ]; then MARK="not cuda"; else MARK="cuda"; fi
timeout 240 python3 -m pytest -q -p no:cacheprovider -m "$MARK" tests/test_cuda.py >"$OUT/cuda_tests.log" 2>&1
say "cuda tests rc $?: $(tail -n 1 "$OUT/cuda_tests.log")"

PLOTS=/tmp/gpu_check_plots
rm -rf "$PLOTS"
for shape in $SHAPES; do
    ckpt=/tmp/gpu_check_ckpt/$shape
    arch=gpt2; [ "$shape" = llama-1b ] && arch=llama
    if [ ! -f "$ckpt/config.json" ]; then
        say "building the $arch $shape checkpoint"
        timeout 300 python3 -m scripts.make_test_model "$ckpt" --arch "$arch" --shape "$shape" --init-range 0.02 \
            >>"$LOG" 2>&1 || { say "checkpoint $shape failed"; continue; }
    fi
    say "benchmark $shape: sweep at $CAPS"
    timeout $((BUDGET * 3 + 60)) python3 -m scripts.benchmark --model "$ckpt" --workload sweep --capacities "$CAPS" \
        --systems "ours:device=$DEVICE,static_hf:device=$DEVICE:dtype=bf16,hf_cb:device=$DEVICE:dtype=bf16" \
        --repeats 1 --warmup 1 --no-overhead --timeout "$BUDGET" $QUICK \
        --json "$OUT/bench_$shape.json" --plot "$PLOTS/$shape" >>"$LOG" 2>&1
    say "benchmark $shape rc $?"
done
[ -d "$PLOTS" ] && tar -C "$PLOTS" -czf "$OUT/plots.tar.gz" .
say "done; wrote: $(ls "$OUT" | tr '\n' ' ')"
