"""Accelerate training runs, one per case; rank 0 writes OUT/NAME.pt per case (losses, weights, checks).

Plain Accelerate (DDP) unless ACCELERATE_USE_ZERO is set, as it is by
``accelerate-zero launch``: then ZeroAccelerator. The cases of one launch run
in sequence in the same processes (a launch costs far more than a case), each
with the launcher's settings unless it gives its own (``--stage``, or
``--mixed-precision`` for a plain reference).

    ACCELERATE_USE_CPU=1 accelerate[-zero] launch --multi_gpu --num_processes 2 \\
        tests/scripts/accelerate_train.py OUT NAME [--steps 6] [--accumulate 2] [--clip 0.5]
        [--save-at 3] [--resume DIR] [--batchnorm 0] [--batch-size 4] [--mixed-precision bf16] [--stage 1]
        [--round-params 1] [--autocast 1] [--optimizer muon] [--memory-budget 64GiB]
        [--then NAME [options] ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from accelerate_zero.plugin import zero_requested  # noqa: E402
from tests.models import SEQ, TinyTransformer, TokenDataset, lm_loss, make_optimizer  # noqa: E402

THEN = "--then"  # separates the cases of one launch


def case_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--batchnorm", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    # Accelerate steps schedulers once per process per optimizer step, so a
    # schedule depends on the process count; runs compared across counts use none.
    parser.add_argument("--scheduler", type=int, default=1)
    # For a plain (DDP) reference sharing a launch with one in another precision; None: the launcher's
    # (the tests give every ZeroAccelerator the launcher's: its users' route).
    parser.add_argument("--mixed-precision", default=None)
    # A stage other than the launcher's, for a case sharing a launch with one at the launcher's stage.
    parser.add_argument("--stage", type=int, default=None)
    # A plain reference whose forward sees every parameter rounded to bf16, as ZeRO's bf16 compute copies.
    parser.add_argument("--round-params", type=int, default=0)
    # The forward under the script's own torch.autocast(bf16) (for ZeroAccelerator(mixed_precision="no")).
    parser.add_argument("--autocast", type=int, default=0)
    parser.add_argument("--optimizer", default="adamw", help="tests.models.make_optimizer's name: adamw, muon, ...")
    # The script's own ZeroPlugin(memory_budget=...), measured on the model's example_input_array.
    parser.add_argument("--memory-budget", default=None)
    return parser


class Bf16ComputeCopies(nn.Module):
    """The model, its forward computed from every parameter rounded to bf16 (differentiably: the gradients
    reach the fp32 parameters, as ZeRO's bf16 compute copies pass theirs to the fp32 masters)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rounded = {name: p.to(torch.bfloat16) for name, p in self.inner.named_parameters()}
        return functional_call(self.inner, rounded, (ids,))  # tied weights stay tied


def train(out: Path, args: argparse.Namespace) -> Accelerator:
    """One case; its accelerator is returned with the process group still up, for the next case."""
    logged: list[str] = []  # what the adapter logs at INFO (Accelerate's way: shown where logging is on)
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("accelerate_zero").addHandler(handler)
    logging.getLogger("accelerate_zero").setLevel(logging.INFO)
    settings = {"gradient_accumulation_steps": args.accumulate, "mixed_precision": args.mixed_precision}
    if zero_requested():
        # Where a stage is given, a script's own ZeroPlugin(stage=N): its other settings come from the launcher.
        plugin = ZeroPlugin(stage=args.stage) if args.stage is not None else None
        if args.memory_budget is not None:
            plugin = ZeroPlugin(memory_budget=args.memory_budget)
        accelerator = ZeroAccelerator(zero_plugin=plugin, **settings)
    else:
        accelerator = Accelerator(**settings)
    torch.manual_seed(0)
    model = TinyTransformer(batchnorm=bool(args.batchnorm))
    if args.memory_budget is not None:
        model.example_input_array = torch.zeros(args.batch_size, SEQ, dtype=torch.long)
    optimizer = make_optimizer(args.optimizer, model)
    if args.round_params:
        model = Bf16ComputeCopies(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    loader = DataLoader(TokenDataset(96), batch_size=args.batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    first_step, loaded = 0, None
    if args.resume:
        accelerator.load_state(args.resume)
        loaded = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
        first_step = args.save_at
        loader = accelerator.skip_first_batches(loader, first_step * args.accumulate)
    losses, rank_losses, clip_norms, step = [], [], [], first_step
    output_dtypes, autocast_enabled = set(), []
    for ids in loader:
        with accelerator.accumulate(model):
            with torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=bool(args.autocast)):
                logits = model(ids)
            output_dtypes.add(str(logits.dtype))
            with accelerator.autocast():
                autocast_enabled.append(torch.is_autocast_enabled("cpu"))
            loss = lm_loss(logits, ids)
            accelerator.backward(loss)
            if args.clip and accelerator.sync_gradients:
                # The norm it returns is compared with DDP's: clipped AdamW steps hide a gradient off by a
                # constant factor (a loss not divided by the accumulation steps), the norm does not.
                clip_norms.append(float(accelerator.clip_grad_norm_(model.parameters(), args.clip)))
            optimizer.step()
            if args.scheduler:
                scheduler.step()
            optimizer.zero_grad()
        per_rank = accelerator.gather(loss.detach())
        losses.append(per_rank.mean().item())
        rank_losses.append(per_rank.tolist())
        if accelerator.sync_gradients:
            step += 1
            if args.save_at == step and not args.resume:
                accelerator.save_state(str(out / f"{args.name}-state"))
            if step == args.steps:
                break
    weights = {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}
    if accelerator.is_main_process:
        accelerator.print(f"{args.name}: {type(accelerator).__name__} losses {losses}")
    accelerator.save_model(model, str(out / f"{args.name}-model"))
    if accelerator.is_main_process:
        engine = getattr(accelerator, "engine", None)
        torch.save(
            {
                "losses": losses,
                "rank_losses": rank_losses,  # [micro-batch][rank]
                "clip_norms": clip_norms,  # what clip_grad_norm_ returned, per optimizer step
                "weights": weights,
                "loaded": loaded,
                "accelerator": type(accelerator).__name__,
                "mixed_precision": accelerator.mixed_precision,
                "output_dtypes": output_dtypes,
                "autocast_enabled": all(autocast_enabled),
                "num_processes": accelerator.num_processes,
                "shard_group_size": engine.shard_group_size if engine is not None else None,
                "fit": engine.fit.summary() if engine is not None and engine.fit is not None else None,
                "stage": engine.config.stage if engine is not None else None,
                "logged": logged,
            },
            out / f"{args.name}.pt",
        )
    accelerator.wait_for_everyone()
    logging.getLogger("accelerate_zero").removeHandler(handler)  # the next case logs its own
    return accelerator


def split_cases(argv: list[str]) -> list[list[str]]:
    """Each case's arguments: ``argv`` split at ``--then``."""
    cases: list[list[str]] = [[]]
    for argument in argv:
        if argument == THEN:
            cases.append([])
        else:
            cases[-1].append(argument)
    return cases


def main() -> None:
    out, *cases = sys.argv[1:]
    torch.set_num_threads(1)
    parser = case_parser()
    for index, case in enumerate(split_cases(cases)):
        if index:  # Accelerate's state is made once per process: a fresh one per case, on the same process group
            AcceleratorState._reset_state()
            GradientState._reset_state()
        accelerator = train(Path(out), parser.parse_args(case))
    accelerator.end_training()


if __name__ == "__main__":
    main()
