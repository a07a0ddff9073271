#!/usr/bin/env bash
# Every check that needs a GPU, in one command that fits a lent GPU's 15 minutes (about 8 here on an H100):
# the machine and versions, the CUDA tests, the one-GPU benchmarks (ours beside DDP and FSDP2; NCCL, world
# size 1) and the host AdamW timings. Results go to $OUT (default benchmarks/out/gpu); record them in
# benchmarks/GPU.md.
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, lightning, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'lightning', lightning.__version__, 'accelerate', accelerate.__version__)"
    echo "cpus $(nproc)"
} 2>&1 | tee "$OUT/machine.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py tests/test_stream_schedule.py 2>&1 |
    tee "$OUT/tests.log" || status=1
timeout 270 python3 benchmarks/run_all.py --device cuda --sizes small large \
    --contestants ddp fsdp2 zero1 zero2 zero3 zero1_overlap --no-plots --out /tmp/gpu-bench 2>&1 |
    tee "$OUT/bench.log" || status=1
cp /tmp/gpu-bench/all-cuda.json "$OUT/" 2>/dev/null || status=1
timeout 90 python3 benchmarks/host_adam.py 2>&1 | tee "$OUT/host_adam.log" || status=1
exit $status
