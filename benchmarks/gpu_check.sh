#!/usr/bin/env bash
# On a CUDA machine: build the extension with its CUDA kernels, run the CUDA tests, then the CUDA
# benchmarks; everything lands in the folder given. Uses the python3 on PATH (or $PYTHON), which
# must have a CUDA build of torch, pytest and tqdm (matplotlib optional for the plots).
#   benchmarks/gpu_check.sh OUT_DIR
set -euo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/machine.txt"

FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
  "$python" setup.py -q build_ext --inplace 2>&1 | tail -n 20 | tee "$out/build.log"

FASTHOOKS_REQUIRE_EXT=1 FASTHOOKS_REQUIRE_CUDA_KERNEL=1 "$python" -m pytest -q -p no:cacheprovider \
  tests/test_cuda.py tests/test_operator.py tests/test_extras.py tests/test_activation_stats.py \
  tests/test_robustness.py tests/test_extension.py \
  2>&1 | tail -n 40 | tee "$out/tests.log"

for dtype in float32 bfloat16; do
  "$python" benchmarks/op_throughput.py --device cuda --dtype "$dtype" \
    --sizes-mb 1 4 16 64 256 1024 --out "$out/op_throughput_$dtype" 2>&1 | tail -n 30
done | tee "$out/op_throughput.log"

"$python" benchmarks/gpu_training_step.py --out "$out/training_step" 2>&1 | tail -n 20 \
  | tee "$out/training_step.log"
