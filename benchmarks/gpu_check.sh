#!/usr/bin/env bash
# The GPU check of lightning-dpmp: every capability on ONE CUDA GPU in one prepared run of at most 8 minutes
# (benchmarks/gpu_checks.py holds the checks and their sizes; benchmarks/README.md, "GPU check", says what each
# one asserts):
#   gloo_cuda_probe   gloo carries CUDA tensors between 4 processes on cuda:0 (NCCL refuses two ranks on one GPU)
#   parity_1x2, parity_2x1, parity_2x2, parity_pp
#                     float64 weights within 1e-8 of one process, exact collectives per step, at (dp,mp) = (1,2),
#                     (2,1), (2,2) plain / zero=3 / sequence parallel, and (dp,pp,mp) = (1,2,2)
#   pretrained        lightning_dpmp.from_pretrained at mp=2 -> fine-tune (float64 parity) -> save_pretrained
#   hydra_train, hydra_resume
#                     examples/train.py trainer=gpu (NCCL, world size 1, bf16-mixed), a save, a resume from it
#   compile           DPMPStrategy(compile=True) vs eager: step times, float32 weight distance
#   mfu               the benchmark Llama in bf16: tokens/s, MFU against the device's dense bf16 peak, and plain
#                     Lightning's tokens/s in the same run (our overhead at mp=1 as a ratio)
# Prints one summary table at the end and writes it to $GPU_CHECK_OUT/summary.md (default benchmarks/results/gpu/),
# with results/<check>.json and logs/. A failing check prints its name and log tail; the run goes on to the
# summary; the exit code is 1 when any check did not pass. No CUDA GPU (without --device cpu): exit 2.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine
#   bash benchmarks/gpu_check.sh --device cpu    # dry mode: the same checks and code on the CPU, tiny sizes
#                                                # (default output: ${TMPDIR:-/tmp}/lightning_dpmp_gpu_check_dry)
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
DEVICE=cuda
while (($#)); do
  case "$1" in
    --device) DEVICE="${2:-}"; shift 2 ;;
    --device=*) DEVICE="${1#--device=}"; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {print}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (use --device cpu for the dry mode)" >&2; exit 2 ;;
  esac
done
if [[ "$DEVICE" != "cuda" && "$DEVICE" != "cpu" ]]; then
  echo "gpu_check.sh: --device must be cuda or cpu, got '$DEVICE'" >&2; exit 2
fi
if [[ "$DEVICE" == "cpu" ]]; then
  OUT="${GPU_CHECK_OUT:-${TMPDIR:-/tmp}/lightning_dpmp_gpu_check_dry}"
else
  OUT="${GPU_CHECK_OUT:-$ROOT/benchmarks/results/gpu}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT" || exit 1

for f in benchmarks/gpu_checks.py benchmarks/gpt_bench.py examples/train.py tests/distributed/parity_worker.py \
         tests/distributed/pipeline_worker.py tests/distributed/pretrained_worker.py tests/support/reference.py; do
  [[ -e "$f" ]] || { echo "gpu_check.sh: $f is missing" >&2; exit 1; }
done

# One torch import: refuse a CUDA run without CUDA (exit 2), else describe the device (summary.md's header).
info="$("$PY" - "$DEVICE" <<'PYEOF'
import platform, sys
import torch
device = sys.argv[1]
if device == "cuda" and not torch.cuda.is_available():
    sys.exit(2)
gpu = (f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, CUDA {torch.version.cuda}"
       if torch.cuda.is_available() else "none")
text = f"Device: --device {device} | GPU: {gpu} | torch {torch.__version__} | host {platform.node()}"
print(text)
PYEOF
)"
probe=$?
if ((probe == 2)); then
  echo "gpu_check.sh: NO CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was checked." >&2
  echo "gpu_check.sh: run 'bash benchmarks/gpu_check.sh --device cpu' for the dry mode on the CPU." >&2
  exit 2
elif ((probe != 0)); then
  echo "gpu_check.sh: python with torch did not start (exit $probe); nothing was checked." >&2
  exit 1
fi
mkdir -p "$OUT" || exit 1
echo "$info" | tee "$OUT/device.txt"

"$PY" benchmarks/gpu_checks.py all --device "$DEVICE" --out "$OUT"
code=$?
if ((code == 0)); then
  echo "gpu_check.sh: all checks passed; $OUT/summary.md"
else
  echo "gpu_check.sh: checks FAILED (exit $code); $OUT/summary.md, logs in $OUT/logs/" >&2
fi
exit "$code"
