#!/usr/bin/env bash
# Issue 15's device check in one call, at most 8 minutes on one GPU: training throughput of the SDXL UNet and the
# FLUX.2 [klein] 4B transformer at real size, eager vs --torch_compile, batch 1 and the largest batch within 80 GB,
# and klein with an NF4 base (see tests/benchmarks/device_throughput.py). Writes
# tests/benchmarks/results/device_<gpu>.{md,json}, and copies them to $OUT when that is set (the device runner's
# folder of files to bring back). Extra arguments go to device_throughput.py, e.g. --models sdxl --modes compiled.
#
#     bash tests/benchmarks/device.sh
set -uo pipefail
cd "$(dirname "$0")/../.."

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi: not found"
python -c "import torch, diffusers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available',
torch.cuda.is_available(), 'diffusers', diffusers.__version__)"

# The script shares --budget_s among its configurations and kills each at the end of its share; the outer
# timeout is the hard stop (SIGTERM first: the script then kills its running configuration and exits).
timeout --kill-after=10 465 python -m tests.benchmarks.device_throughput --budget_s 430 "$@"
status=$?

if [ -n "${OUT:-}" ]; then
    cp tests/benchmarks/results/device_*.md tests/benchmarks/results/device_*.json "$OUT"/ 2>/dev/null
fi
exit $status
