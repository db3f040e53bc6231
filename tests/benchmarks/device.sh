#!/usr/bin/env bash
# The device checks in one call, at most 8 minutes on one GPU. Writes tests/benchmarks/results/device_*_<gpu>.{md,json}
# and copies them to $OUT when that is set (the device runner's folder of files to bring back).
#
#     bash tests/benchmarks/device.sh [memory]      # issue 43: each family at real size, bf16 / int8 x swap 0 / N:
#                                                  # step time and peak memory beside the memory plan's estimate
#                                                  # (tests/benchmarks/device_memory.py)
#     bash tests/benchmarks/device.sh throughput    # issue 15: SDXL UNet and FLUX.2 [klein] 4B throughput, eager vs
#                                                  # --torch_compile (tests/benchmarks/device_throughput.py)
#
# Extra arguments go to the Python module, e.g. `device.sh memory --families flux2_klein z_image` or
# `device.sh throughput --models sdxl --modes compiled`.
set -uo pipefail
cd "$(dirname "$0")/../.."

mode=memory
if [ $# -gt 0 ] && { [ "$1" = memory ] || [ "$1" = throughput ]; }; then
    mode=$1
    shift
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
python -c "import torch, diffusers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available',
torch.cuda.is_available(), 'diffusers', diffusers.__version__)"

# Each script shares --budget_s among what it runs (memory: starts no family after it; throughput: kills each
# configuration at the end of its share); the outer timeout is the hard stop.
if [ "$mode" = memory ]; then
    timeout --kill-after=10 465 python -m tests.benchmarks.device_memory --budget_s 330 --steps 2 "$@"
else
    timeout --kill-after=10 465 python -m tests.benchmarks.device_throughput --budget_s 430 "$@"
fi
status=$?

if [ -n "${OUT:-}" ]; then
    cp tests/benchmarks/results/device_*.md tests/benchmarks/results/device_*.json "$OUT"/ 2>/dev/null
fi
exit $status
