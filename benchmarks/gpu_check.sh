#!/usr/bin/env bash
# On a CUDA machine, in at most 9 minutes: install the wheel `make wheel` built (dist/, for this
# machine's platform), time the first use of its CUDA kernels, run the CUDA tests (CUDA graphs and
# two streams among them), then the CUDA benchmarks (the operator against torch.sum beside the
# SASS prediction, the binades extra and top_k, the per-channel sums per layout, a training step,
# ParameterStats, the non-finite guard). Each stage has a time limit and a failing stage does not stop the next. Everything
# lands in OUT_DIR/results.md, one section per stage with its status and the end of its output.
# Uses the python3 on PATH (or $PYTHON), which must have a CUDA build of torch, pytest,
# pytest-xdist, hypothesis, numpy, scikit-learn and tqdm (what the tests and benchmarks import).
# Python runs with -P, so that the installed package is the one imported, not the source tree.
#   benchmarks/gpu_check.sh OUT_DIR
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
scratch=build/gpu_check
rm -rf "$scratch" && mkdir -p "$scratch"
export PYTHONUNBUFFERED=1
export FASTHOOKS_CACHE_DIR=$PWD/$scratch/kernel-cache
results=$out/results.md

# stage NAME SECONDS COMMAND...: runs the command under a time limit; its status and the end of
# its output (or of the file it writes, FILE=... before the name) go to results.md.
stage() {
  local file=""
  [[ $1 == FILE=* ]] && file=${1#FILE=} && shift
  local name=$1 seconds=$2
  shift 2
  local start=$SECONDS log=$scratch/${name// /_}.log
  timeout "$seconds" "$@" >"$log" 2>&1
  local rc=$?
  {
    echo "## $name: rc $rc in $((SECONDS - start)) s"
    echo
    if [[ -n $file && -f $file ]]; then cat "$file"; else tail -n 30 "$log"; fi
    echo
  } | tee -a "$results"
}

{
  echo "# gpu_check $(date -u +%FT%TZ)"
  echo
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  echo
} >"$results" 2>&1
cat "$results"

wheel=$(ls dist/fasthooks-*-abi3-*"$(uname -m)".whl 2>/dev/null | head -n 1)
stage install 60 "$python" -m pip install -q --no-deps --force-reinstall \
  "${wheel:-dist/no-wheel-for-this-platform.whl}"

# Each kernel compiled by this torch's NVRTC for this GPU into an empty cache, then found there.
arch=$("$python" -P -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null)
stage FILE="$scratch/compile/kernel_compile.md" first-use 75 "$python" -P \
  benchmarks/kernel_compile.py --arch "${arch:-90}" --out "$scratch/compile"

# What the installation holds, and the fused kernels against the python backend on every device.
stage self-check 30 "$python" -P -m fasthooks

stage tests 115 env FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_REQUIRE_CUDA_KERNEL=1 \
  "$python" -P -m pytest -q -p no:cacheprovider -n 4 -m cuda -rfE tests

for dtype in float32 bfloat16; do
  stage FILE="$scratch/op_$dtype/results.md" "op_throughput $dtype" 45 "$python" -P \
    benchmarks/op_throughput.py --device cuda --dtype "$dtype" --rounds 5 \
    --sizes-mb 1 16 256 1024 --out "$scratch/op_$dtype"
done

# Each kernel's time over torch.sum beside what docs/cuda.md's count of its SASS predicts.
stage FILE="$scratch/roofline.md" roofline 15 "$python" -P benchmarks/roofline_vs_measured.py \
  "$scratch"/op_*/results.json --out "$scratch/roofline.md"

# The binades extra and top_k beside every other extra, torch.sum and the hand-rolled hooks.
stage FILE="$scratch/low_precision/results.md" low_precision 30 "$python" -P \
  benchmarks/low_precision.py --device cuda --numel 67108864 --rounds 5 \
  --out "$scratch/low_precision"

# The running per-channel sums per layout (NCHW runs, channels_last, (tokens, C)) beside the same
# kernels without them, torch.sum and the hand-rolled torch ops.
stage FILE="$scratch/channels/results.md" channel_stats 30 "$python" -P \
  benchmarks/channel_stats.py --device cuda --numel 16777216 --dtypes float32 bfloat16 \
  --rounds 5 --out "$scratch/channels"

stage FILE="$scratch/step/results.md" training_step 45 "$python" -P \
  benchmarks/gpu_training_step.py --steps 10 --rounds 3 --out "$scratch/step"
stage FILE="$scratch/params/results.md" parameter_stats 25 "$python" -P \
  benchmarks/parameter_overhead.py --device cuda --steps 20 --rounds 3 --out "$scratch/params"
stage FILE="$scratch/guard/results.md" nonfinite_guard 25 "$python" -P \
  benchmarks/nonfinite_guard.py --device cuda --rounds 3 --out "$scratch/guard"
exit 0
