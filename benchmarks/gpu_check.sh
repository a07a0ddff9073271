#!/usr/bin/env bash
# Every check that needs a GPU, in one command that fits in 20 minutes on an H100 (the CUDA tests about 5,
# the one-GPU benchmarks about 3, the offload search about 9): the machine and versions, the CUDA tests
# (offload included), the one-GPU benchmarks (ours beside DDP and FSDP2; NCCL, world size 1), the host
# AdamW timings, and the largest model each offload mode trains (beside FSDP2's CPUOffloadPolicy and
# DeepSpeed's ZeRO-Offload). Results go to $OUT (default benchmarks/out/gpu); record them in
# benchmarks/GPU.md. Name parts to run only those (a lent machine's 10-minute command limit, for example):
#
#     OUT=/some/dir bash benchmarks/gpu_check.sh            # tests bench offload
#     bash benchmarks/gpu_check.sh tests bench              # about 8 minutes
#     bash benchmarks/gpu_check.sh offload                  # about 9 minutes
#     bash benchmarks/gpu_check.sh quick                    # at most 8 minutes: what a 15-minute loan fits
#
# quick: the CUDA tests (130 s at most), stages 1-3 beside DDP and FSDP2 on the 168M model (world size 1,
# 140 s), the quantizer's throughput (30 s), and the largest model the CPU-offload mode trains (a 2-minute
# search, zero3_cpu beside zero3). Every step has its own timeout, so the whole stays under 8 minutes even
# where one hangs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench offload)
for part in "${parts[@]}"; do
    case $part in tests | bench | offload | quick) ;; *) echo "unknown part '$part': name tests, bench, offload or quick" >&2; exit 2 ;; esac
done
wants() { [[ " ${parts[*]} " == *" $1 "* ]]; }
status=0
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, lightning, accelerate; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'lightning', lightning.__version__, 'accelerate', accelerate.__version__)"
    echo "cpus $(nproc)"
} 2>&1 | tee "$OUT/machine.txt"
if wants tests; then
    timeout 330 python3 -m pytest -q -p no:cacheprovider -rs tests/distributed/runtime/test_cuda.py tests/distributed/runtime/test_stream_schedule.py \
        tests/distributed/zero_plus_plus/test_zero_plus_plus.py -k "cuda or stream" 2>&1 |
        tee "$OUT/tests.log" || status=1
fi
if wants bench; then
    timeout 270 python3 benchmarks/run_all.py --device cuda --sizes small large \
        --contestants ddp fsdp2 zero1 zero2 zero3 zero1_overlap --no-plots --out /tmp/gpu-bench 2>&1 |
        tee "$OUT/bench.log" || status=1
    cp /tmp/gpu-bench/all-cuda.json "$OUT/" 2>/dev/null || status=1
    timeout 90 python3 benchmarks/host_adam.py 2>&1 | tee "$OUT/host_adam.log" || status=1
    timeout 60 python3 benchmarks/quantization_cost.py --device cuda --numel 4e8 --repeats 5 2>&1 |
        tee "$OUT/quantization_cost.log" || status=1
fi
if wants offload; then
    timeout 570 python3 benchmarks/gpu_offload.py --minutes 8 --out "$OUT/offload" 2>&1 |
        tee "$OUT/offload.log" || status=1
fi
if wants quick; then
    timeout 130 python3 -m pytest -q -p no:cacheprovider -rs tests/distributed/runtime/test_cuda.py \
        tests/distributed/runtime/test_stream_schedule.py 2>&1 | tee "$OUT/tests.log" || status=1
    timeout 140 python3 benchmarks/run_all.py --device cuda --sizes large \
        --contestants ddp fsdp2 zero1 zero2 zero3 --no-plots --out /tmp/gpu-bench 2>&1 |
        tee "$OUT/bench.log" || status=1
    cp /tmp/gpu-bench/all-cuda.json "$OUT/" 2>/dev/null || status=1
    timeout 30 python3 benchmarks/quantization_cost.py --device cuda --numel 4e8 --repeats 5 2>&1 |
        tee "$OUT/quantization_cost.log" || status=1
    timeout 150 python3 benchmarks/gpu_offload.py --minutes 2 --contestants zero3 zero3_cpu \
        --out "$OUT/offload" 2>&1 | tee "$OUT/offload.log" || status=1
fi
exit $status
