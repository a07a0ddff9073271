"""On one GPU: the largest GPT each offload mode trains, with tokens/s and TFLOPS, beside FSDP2's
CPUOffloadPolicy and DeepSpeed's ZeRO-Offload (where it is installed).

    python benchmarks/gpu_offload.py [--minutes 8] [--out benchmarks/out/gpu_offload]
    python benchmarks/gpu_offload.py --device cpu --width 64 --batch 1 --minutes 2   # the plumbing, on a CPU

(On a CPU FSDP2's CPUOffloadPolicy refuses to run: it needs an accelerator.)

For each contestant, blocks of a width-2048 GPT (bf16 compute, fp32 master and AdamW) are added until a
run of three steps fails (out of memory, on the device or the host), starting from the depth its memory
formula predicts; the deepest that trained is its largest model. Every probe is a process of its own
(world size 1), built on the meta device and materialised the way its framework does it for a model too
large for the device. TFLOPS are 6 × parameters × tokens/s (the usual estimate, attention not counted).
Writes ``gpu_offload.json`` and ``GPU_OFFLOAD.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
from gpt import GPT, GPTBlock, GPTConfig, next_token_loss, synthetic_batch  # noqa: E402

# name -> what moves off the device (for the table) and the bytes per parameter left on the device (the
# starting guess of the search): bf16 parameters 2, fp32 gradients 4, fp32 master 4, Adam 8.
CONTESTANTS = {
    "zero3": ("nothing", 18.0),
    "zero3_cpu": ("optimizer (master, moments, gradient shard) to host", 6.0),
    "zero3_cpu_params": ("optimizer and parameters to host", 1.0),
    "zero3_cpu_params_in_backward": ("the same, host step during backward", 1.0),
    "zero3_nvme_cpu_params": ("master and moments to disk, parameters to host", 1.0),
    "zero3_infinity": ("master, moments and parameters to disk", 1.0),
    "fsdp2": ("nothing", 18.0),
    "fsdp2_offload": ("CPUOffloadPolicy: parameters, gradients, optimizer to host", 1.0),
    "deepspeed3_offload": ("offload_optimizer and offload_param: cpu", 1.0),
}
HOST_BYTES_PER_PARAM = 18.0  # with offload the host holds master, moments, gradients and bf16 parameters
STEPS = 3


def _config(width: int, depth: int) -> GPTConfig:
    return GPTConfig(vocab_size=32000, seq_len=1024, width=width, depth=depth, heads=max(1, width // 128))


def _params(config: GPTConfig) -> int:
    """The GPT's parameters (the head tied to the embedding): per block 12w² + 13w."""
    width = config.width
    return config.vocab_size * width + config.seq_len * width + 2 * width + config.depth * (12 * width**2 + 13 * width)


def _build(name: str, config: GPTConfig, device: torch.device, scratch: str):  # type: ignore[no-untyped-def]
    """(model, one training step) for ``name``, the model materialised only where its framework puts it."""
    with torch.device("meta"):
        model = GPT(config)
    if name.startswith("zero3"):
        from zero_core import MixedPrecision, WrapPolicy, ZeroConfig, ZeroEngine

        on_disk = "nvme" in name or "infinity" in name  # zero3_infinity: both offloads on NVMe
        settings = {
            "offload_optimizer": "nvme" if on_disk else "cpu" if "_cpu" in name else "none",
            "offload_params": "nvme" if "infinity" in name else "cpu" if "params" in name else "none",
            "offload_step_in_backward": name.endswith("in_backward"),
            "offload_dir": scratch,
        }
        precision = MixedPrecision(compute_dtype=torch.bfloat16) if device.type == "cuda" else MixedPrecision()
        config_ = ZeroConfig(stage=3, wrap_policy=WrapPolicy((GPTBlock,)), mixed_precision=precision, **settings)
        engine = ZeroEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config_, device=device)
        return model, lambda ids: _step(model, ids, engine.backward, engine.step)
    if name.startswith("fsdp2"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        offload = CPUOffloadPolicy() if name.endswith("offload") else OffloadPolicy()
        dtype = torch.bfloat16 if device.type == "cuda" else None
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, offload_policy=offload, mp_policy=policy)
        fully_shard(model, offload_policy=offload, mp_policy=policy)
        # torchtitan's way: with CPU offload the sharded parameters are materialised on the host.
        model.to_empty(device="cpu" if name.endswith("offload") else device)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, lambda ids: _step(model, ids, torch.Tensor.backward, lambda: _stepped(optimizer))
    if name.startswith("deepspeed"):
        import deepspeed

        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.0,
            "bf16": {"enabled": device.type == "cuda"},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "offload_param": {"device": "cpu", "pin_memory": True},
            },
        }
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = GPT(config)
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        return engine, lambda ids: _step(engine, ids, engine.backward, engine.step)
    raise ValueError(name)


def _stepped(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _step(model, ids, backward, step) -> float:  # type: ignore[no-untyped-def]
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        loss = next_token_loss(model(ids), ids)
    backward(loss)
    step()
    return loss.item()


def probe(name: str, width: int, depth: int, batch: int, device_kind: str, out: Path) -> None:
    """One process: build ``name`` at ``depth``, train ``STEPS`` steps, write what it measured to ``out``."""
    import torch.distributed as dist

    on_gpu = device_kind == "cuda"
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo")
    config = _config(width, depth)
    with tempfile.TemporaryDirectory(dir=os.environ.get("ZERO_BENCH_OFFLOAD_DIR")) as scratch:
        model, step = _build(name, config, device, scratch)
        numel = _params(config)
        times = []
        for index in range(STEPS):
            ids = synthetic_batch(config, batch, index, 0).to(device)
            started = time.perf_counter()
            loss = step(ids)
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times[1:])  # the first step warms up
    tokens = batch * config.seq_len / seconds
    out.write_text(
        json.dumps(
            {
                "depth": depth,
                "params": numel,
                "step_s": seconds,
                "tokens_per_s": tokens,
                "tflops": 6 * numel * tokens / 1e12,
                "last_loss": loss,
                "device_peak_bytes": torch.cuda.max_memory_allocated(device) if on_gpu else None,
            }
        )
    )
    dist.destroy_process_group()


def _run_probe(name: str, args: argparse.Namespace, depth: int, timeout: float) -> dict | None:
    out = Path(args.out) / f"{name}-d{depth}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", __file__, "--probe", name]
    command += ["--depth", str(depth), "--width", str(args.width), "--batch", str(args.batch)]
    command += ["--device", args.device, "--out", str(args.out)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=max(10.0, timeout))
    except subprocess.TimeoutExpired:
        return {"depth": depth, "failed": "out of time"}
    if result.returncode != 0 or not out.exists():
        reason = "out of memory" if "out of memory" in (result.stderr + result.stdout).lower() else "failed"
        return {"depth": depth, "failed": reason, "stderr": result.stderr[-600:]}
    return json.loads(out.read_text())


def largest(name: str, args: argparse.Namespace, deadline: float) -> dict:
    """The deepest model that trains, searched up and down from the formula's guess until ``deadline``."""
    on_device = CONTESTANTS[name][1]
    block = 12 * args.width**2
    device_bytes = torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else 64 * block * 18
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    guess = min(0.7 * device_bytes / on_device, 0.6 * host_bytes / HOST_BYTES_PER_PARAM) / block
    depth = max(1, int(guess))
    probes: list[dict] = []
    best = None
    while time.monotonic() < deadline:
        record = _run_probe(name, args, depth, deadline - time.monotonic())
        probes.append(record)
        if record.get("failed") == "failed":
            break  # not a size limit (a framework missing, a bug): the stderr says which
        if "failed" not in record:
            best = record if best is None or record["depth"] > best["depth"] else best
        tried = {p["depth"]: "failed" not in p for p in probes}
        fits = [d for d, ok in tried.items() if ok]
        fails = [d for d, ok in tried.items() if not ok]
        low, high = (max(fits) if fits else 0), (min(fails) if fails else None)
        if high is not None and high - low <= max(1, low // 8):
            break  # within an eighth: close enough
        depth = (low + high) // 2 if high is not None else max(low + 1, int(low * 1.5))
        if depth in tried or depth < 1:
            break
    return {"contestant": name, "moves": CONTESTANTS[name][0], "largest": best, "probes": probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--depth", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--minutes", type=float, default=8.0, help="for the whole search, shared by the contestants")
    parser.add_argument("--contestants", nargs="+", default=list(CONTESTANTS), choices=list(CONTESTANTS))
    parser.add_argument("--out", default=str(HERE / "out" / "gpu_offload"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.probe:
        probe(
            args.probe,
            args.width,
            args.depth,
            args.batch,
            args.device,
            Path(args.out) / f"{args.probe}-d{args.depth}.json",
        )
        return
    started = time.monotonic()
    share = args.minutes * 60 / len(args.contestants)
    results = []
    for index, name in enumerate(args.contestants):
        results.append(largest(name, args, started + share * (index + 1)))
        print(json.dumps({k: results[-1][k] for k in ("contestant", "largest")}), flush=True)
    (Path(args.out) / "gpu_offload.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Largest model per offload mode on one {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'}",
        "",
        f"`python benchmarks/gpu_offload.py --width {args.width} --batch {args.batch} --minutes {args.minutes}`; "
        f"torch {torch.__version__}; GPT width {args.width}, sequence 1024, bf16 compute (on a GPU), AdamW.",
        "",
        "| contestant | moves off the device | largest trained (params) | depth | tokens/s | TFLOPS | probes |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        best, probes = (
            result["largest"],
            ", ".join(f"{p['depth']}{'' if 'failed' not in p else ' ' + p['failed']}" for p in result["probes"]),
        )
        if best is None:
            lines.append(f"| {result['contestant']} | {result['moves']} | none | | | | {probes} |")
            continue
        lines.append(
            f"| {result['contestant']} | {result['moves']} | {best['params'] / 1e9:.2f}B | {best['depth']} | "
            f"{best['tokens_per_s']:.0f} | {best['tflops']:.1f} | {probes} |"
        )
    (Path(args.out) / "GPU_OFFLOAD.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
