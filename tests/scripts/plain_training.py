"""A script launched by ``accelerate-zero launch`` that trains with a plain Accelerator or Trainer (which would
ignore the ZeRO settings), or with ZeroAccelerator after an evaluation forward on the unprepared model.
Each process writes OUT/<case>.rank<R> once its optimizer stepped (plain cases must never get there).

    ACCELERATE_USE_CPU=1 accelerate-zero launch --multi_gpu --num_processes 2 \\
        tests/scripts/plain_training.py OUT accelerator|trainer|zero
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.models import TinyTransformer, batch, lm_loss, make_optimizer  # noqa: E402


def stepped(out: Path, case: str, rank: int) -> None:
    (out / f"{case}.rank{rank}").write_text("stepped")


def accelerate_loop(accelerator, out: Path, case: str) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, width=16)
    with torch.no_grad():  # evaluating before prepare is not training: it passes the check
        model(batch(0, 0))
    model(batch(0, 0)).sum().backward()  # nor is a forward and backward without a step (a lazy init, a probe)
    model.zero_grad(set_to_none=True)
    model, optimizer = accelerator.prepare(model, make_optimizer("adamw", model))
    ids = batch(1, accelerator.process_index)
    accelerator.backward(lm_loss(model(ids), ids))
    optimizer.step()
    stepped(out, case, accelerator.process_index)


def trainer_loop(out: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from tests.scripts.trainer_run import Tokens, model

    arguments = TrainingArguments(
        output_dir=str(out / "trainer"), use_cpu=True, per_device_train_batch_size=2, max_steps=2,
        report_to="none", disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    plain = Trainer(model=model(), args=arguments, train_dataset=Tokens(8, 1))
    plain.train()
    stepped(out, "trainer", plain.args.process_index)


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    if case == "accelerator":
        from accelerate import Accelerator

        accelerate_loop(Accelerator(), out, case)
    elif case == "zero":
        from accelerate_zero import ZeroAccelerator

        accelerate_loop(ZeroAccelerator(), out, case)
    else:
        trainer_loop(out)


if __name__ == "__main__":
    main()
