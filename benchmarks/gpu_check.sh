#!/usr/bin/env bash
# On a CUDA machine: install the wheel `make wheel` built (dist/, for this machine's platform),
# time the first use of its CUDA kernels, run the CUDA tests, then the CUDA benchmarks. Each stage
# has a time limit and a failing stage does not stop the next; at most nine files land in the
# folder given (status.txt says how each stage ended). Uses the python3 on PATH (or $PYTHON),
# which must have a CUDA build of torch, pytest and tqdm. Python runs with -P, so that the
# installed package is the one imported, not the source tree.
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

# stage NAME SECONDS LOG COMMAND...: runs the command under a time limit, its output in LOG.
stage() {
  local name=$1 seconds=$2 log=$3
  shift 3
  local start=$SECONDS
  timeout "$seconds" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - start)) s" | tee -a "$out/status.txt"
  tail -n 25 "$log"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} >"$out/setup.log" 2>&1
cat "$out/setup.log"

wheel=$(ls dist/fasthooks-*-abi3-*"$(uname -m)".whl 2>/dev/null | head -n 1)
stage install 120 "$out/setup.log" "$python" -m pip install -q --no-deps --force-reinstall \
  "${wheel:-dist/no-wheel-for-this-platform.whl}"

# Each kernel compiled by this torch's NVRTC for this GPU into an empty cache, then found there.
arch=$("$python" -P -c "import torch; print('%d%d' % torch.cuda.get_device_capability())" 2>/dev/null)
stage first-use 180 "$out/setup.log" "$python" -P benchmarks/kernel_compile.py --arch "${arch:-90}" \
  --out "$scratch/kernel_compile"
cp "$scratch/kernel_compile/kernel_compile.md" "$out/kernel_compile.md" 2>/dev/null

# What the installation holds, and the fused kernels against the python backend on every device.
stage self-check 120 "$out/setup.log" "$python" -P -m fasthooks

# Registers and spills of each kernel for this GPU's architecture, beside docs/cuda.md's table.
stage resources 120 "$out/setup.log" "$python" -P benchmarks/cuda_resources.py --archs "${arch:-90}"

stage tests 300 "$out/tests.log" env FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_REQUIRE_CUDA_KERNEL=1 \
  "$python" -P -m pytest -q -p no:cacheprovider -n 4 -m cuda -rfE tests

for dtype in float32 bfloat16; do
  stage "op_throughput $dtype" 150 "$out/bench.log" "$python" -P benchmarks/op_throughput.py \
    --device cuda --dtype "$dtype" --sizes-mb 1 4 16 64 256 1024 --out "$scratch/op_$dtype"
  cp "$scratch/op_$dtype/results.md" "$out/op_throughput_$dtype.md" 2>/dev/null
done

# Each kernel's time over torch.sum beside what docs/cuda.md's count of its SASS predicts.
stage roofline 60 "$out/bench.log" "$python" -P benchmarks/roofline_vs_measured.py \
  "$scratch"/op_*/results.json --out "$out/roofline_vs_measured.md"

stage training_step 150 "$out/bench.log" "$python" -P benchmarks/gpu_training_step.py \
  --out "$scratch/training_step"
cp "$scratch/training_step/results.md" "$out/training_step.md" 2>/dev/null
exit 0
