"""ZeroAccelerator's save_state/load_state when a save fails, in one CPU process; prints a JSON report.

python tests/scripts/accelerate_failures.py WORKDIR [--asynchronous]

``--asynchronous``: the same under ``asynchronous_checkpoints`` (``background``): save_state returns while the
model and optimizer are written; a write that fails is raised at a later step and its folder removed.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.utils import ProjectConfiguration  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from tests.models import TinyTransformer, batch, lm_loss, make_optimizer  # noqa: E402
from zero_core import CheckpointError  # noqa: E402


def fail_writes_into(directory_name: str):  # type: ignore[no-untyped-def]
    """Make DCP writes into one kind of directory fail as a full disk would."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        if directory_name in str(self.path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
    return original


def prepared(work: Path, asynchronous: bool):  # type: ignore[no-untyped-def]
    """An accelerator (automatic naming, one checkpoint kept), its prepared model, and a training step."""
    accelerator = ZeroAccelerator(
        zero_plugin=ZeroPlugin(stage=3, asynchronous_checkpoints=asynchronous),
        project_config=ProjectConfiguration(project_dir=str(work), automatic_checkpoint_naming=True, total_limit=1),
    )
    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, width=16)
    optimizer = make_optimizer("adamw", model)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train_step(step: int) -> None:
        ids = batch(step, 0)
        accelerator.backward(lm_loss(model(ids), ids))
        optimizer.step()
        optimizer.zero_grad()

    return accelerator, model, train_step


def background(work: Path) -> dict:
    accelerator, model, train_step = prepared(work, asynchronous=True)
    engine = accelerator.engine
    folders = lambda: sorted(p.name for p in (work / "checkpoints").iterdir())  # noqa: E731
    report: dict = {}
    train_step(0)
    accelerator.save_state()
    accelerator.save_state()  # waits for the first (no step between: it is collected here, not at a step)
    report["returned while written"] = engine.checkpoint_being_written is not None
    report["folders while the second is written"] = folders()  # the first is pruned once the second is written
    saved = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    train_step(2)  # changes the weights while the save may still be written
    engine.wait_for_checkpoint()
    report["folders after two saves"] = folders()
    original = fail_writes_into(".pytorch_model_zero_0.partial")
    accelerator.save_state()
    report["failing save returned"] = True
    report["failed write"] = "not raised"
    for step in range(3, 40):  # raised at the first step after the write ended
        try:
            train_step(step)
        except CheckpointError as error:
            report["failed write"] = str(error)
            break
    FileSystemWriter.write_data = original  # type: ignore[method-assign]
    report["folders after a failed write"] = folders()
    accelerator.load_state()
    report["latest loads the second save"] = all(
        torch.equal(saved[k], v) for k, v in accelerator.get_state_dict(model).items()
    )
    # What a save killed mid-write leaves (the process gone: nothing removed it): Accelerate's own files and the
    # model's partial copy, in a newer folder. load_state() removes it, says so, and loads the one before.
    killed = work / "checkpoints" / "checkpoint_3"
    shutil.copytree(work / "checkpoints" / "checkpoint_1", killed)
    shutil.rmtree(killed / "pytorch_model_zero_0")
    (killed / ".pytorch_model_zero_0.partial").mkdir()
    train_step(40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.load_state()
    report["after a killed save: warned"] = [str(w.message) for w in caught if "load_state()" in str(w.message)]
    report["after a killed save: folders"] = folders()
    report["after a killed save: loads the second save"] = all(
        torch.equal(saved[k], v) for k, v in accelerator.get_state_dict(model).items()
    )
    return report


def main() -> None:
    work = Path(sys.argv[1])
    torch.set_num_threads(1)
    if sys.argv[2:] == ["--asynchronous"]:
        print(json.dumps(background(work)))
        return
    accelerator, model, train_step = prepared(work, asynchronous=False)
    report: dict = {}
    train_step(0)
    accelerator.save_state()
    saved = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    train_step(1)
    original = fail_writes_into(".pytorch_model_zero_0.partial")
    try:
        accelerator.save_state()
        report["failed save"] = "returned normally"
    except CheckpointError as error:
        report["failed save"] = str(error)
    FileSystemWriter.write_data = original  # type: ignore[method-assign]
    report["folders after a failed save"] = sorted(p.name for p in (work / "checkpoints").iterdir())
    accelerator.load_state()
    report["latest loads the first save"] = all(
        torch.equal(saved[k], v) for k, v in accelerator.get_state_dict(model).items()
    )
    train_step(2)
    import accelerate.accelerator as accelerate_module  # Accelerate's own files failing this time

    original_state_saver = accelerate_module.save_accelerator_state

    def disk_full(output_dir, *args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), output_dir)

    accelerate_module.save_accelerator_state = disk_full
    try:
        accelerator.save_state()
        report["accelerate's files fail"] = "returned normally"
    except CheckpointError as error:
        report["accelerate's files fail"] = str(error)
    accelerate_module.save_accelerator_state = original_state_saver
    report["folders after accelerate's files failed"] = sorted(p.name for p in (work / "checkpoints").iterdir())
    accelerator.save_state()
    report["folders after a good save"] = sorted(p.name for p in (work / "checkpoints").iterdir())

    # An explicit folder reused: the optimizer directory saved, the model directory failed.
    accelerator.project_configuration.automatic_checkpoint_naming = False
    pair = work / "pair"
    accelerator.save_state(str(pair))
    train_step(3)
    original = fail_writes_into(".pytorch_model_zero_0.partial")
    try:
        accelerator.save_state(str(pair))
    except CheckpointError:
        pass
    FileSystemWriter.write_data = original  # type: ignore[method-assign]
    before = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    try:
        accelerator.load_state(str(pair))
        report["mixed pair"] = "loaded"
    except CheckpointError as error:
        report["mixed pair"] = str(error)
    report["mixed pair left the model alone"] = all(
        torch.equal(before[k], v) for k, v in accelerator.get_state_dict(model).items()
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
