"""The wild corpus' files written for a plain Accelerate script (its own optimizer, as Accelerate's nlp_example.py
and open-instruct's finetune.py build theirs), each trained unedited under the ``accelerate-zero launch`` flags its
source launches it with, beside the same run launched with the native flags (``--zero_stage N``,
``--offload_*_device``, ``--mixed_precision``) and, where the file clips (a number, or "auto": 1.0 under
Accelerate), ``accelerator.clip_grad_norm_(..., 1.0)`` in the loop. Rank 0 writes OUT/<case>.json with both runs'
losses, skipped steps and final weights.

    ACCELERATE_USE_CPU=1 accelerate-zero launch <CASE's flags> --multi_gpu --num_processes 2 \\
        tests/scripts/wild_corpus_accelerate.py OUT CASE [CASE ...]

The launcher reads the first CASE's flags; the others are read here as the launcher reads them
(``wild_corpus_launcher.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate_zero import ZeroAccelerator  # noqa: E402
from tests.models import TinyTransformer, TokenDataset, lm_loss  # noqa: E402
from tests.scripts.wild_corpus_launcher import attempt, fresh_state, launcher_variables, read_as_the_launcher  # noqa: E402

STEPS, LR, WEIGHT_DECAY = 8, 1e-2, 0.01  # fp16's loss scaling skips the first steps: several remain
# Per case: the launch flags its source gives (its file unedited), the native flags meaning the same, and the
# clipping the file asks for (done by the loop in the native run).
CASES = {
    # Accelerate's DeepSpeed guide, "ZeRO Stage-2 DeepSpeed Plugin Example", for examples/nlp_example.py
    # (fp16 runs on this CPU: the engine's own loss scaling, as Accelerate's DeepSpeed has it).
    "accelerate_docs_zero2_plugin": dict(
        launch=["--config_file", "accelerate_docs_zero2_plugin.yaml"],
        native=["--zero_stage", "2", "--gradient_accumulation_steps", "1", "--mixed_precision", "fp16"],
        clip=1.0,
    ),
    # The same guide's "ZeRO Stage-3 with CPU Offload DeepSpeed Plugin Example".
    "accelerate_docs_zero3_cpu_offload_plugin": dict(
        launch=["--config_file", "accelerate_docs_zero3_cpu_offload_plugin.yaml"],
        native=["--zero_stage", "3", "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"]
        + ["--gradient_accumulation_steps", "1", "--mixed_precision", "fp16"],
        clip=1.0,
    ),
    # open-instruct's Accelerate YAML for its own Accelerate loops (deepspeed_multinode_launcher: standard).
    "open_instruct_deepspeed_zero2": dict(
        launch=["--config_file", "open_instruct_deepspeed_zero2.yaml"],
        native=["--zero_stage", "2", "--mixed_precision", "bf16"],
        clip=None,
    ),
    # open-instruct's finetune.py launch: `accelerate launch --mixed_precision bf16 --use_deepspeed
    # --deepspeed_config_file stage3_offloading_accelerate.conf` ("auto"s, no optimizer section); --use_deepspeed
    # is dropped, as accelerate-zero's refusal of it says. Its gradient_clipping "auto" is 1.0 under Accelerate.
    "open_instruct_stage3_offloading_accelerate": dict(
        launch=["--mixed_precision", "bf16"]
        + ["--deepspeed_config_file", "open_instruct_stage3_offloading_accelerate.conf"],
        native=["--zero_stage", "3", "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"]
        + ["--mixed_precision", "bf16"],
        clip=1.0,
    ),
}


def train(clip: float | None) -> dict:
    """STEPS optimizer steps of a plain Accelerate loop on the launcher's settings, clipping at ``clip`` if given."""
    accelerator = ZeroAccelerator()
    torch.manual_seed(0)
    model = TinyTransformer(blocks=2, batchnorm=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    data = DataLoader(TokenDataset(2 * STEPS * accelerator.num_processes), batch_size=2)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    losses, norms, skipped = [], [], []
    for ids in data:
        loss = lm_loss(model(ids), ids)
        accelerator.backward(loss)
        if clip is not None:
            norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        skipped.append(bool(optimizer.step_was_skipped))
    weights = {name: t.float().flatten().tolist() for name, t in accelerator.get_state_dict(model).items()}
    engine, plugin = accelerator.engine, accelerator.zero_plugin  # what it trained with
    return {
        "losses": losses,
        "norms": norms,
        "skipped": skipped,
        "weights": weights,
        "stage": engine.stage,
        "offload": [plugin.offload_optimizer, plugin.offload_params],
        "settings": {f.name: getattr(plugin, f.name) for f in dataclasses.fields(plugin)},
        "mixed_precision": accelerator.mixed_precision,
        "accumulation": accelerator.gradient_accumulation_steps,
    }


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    launched = launcher_variables()
    for index, name in enumerate(cases):
        case, report = CASES[name], {}

        def run(arguments: list[str], clip: float | None) -> dict:
            variables = read_as_the_launcher(arguments)
            if index == 0 and arguments is case["launch"]:
                report["reread_matches_launcher"] = variables == launched
            fresh_state()
            return train(clip)

        report["file"] = attempt(lambda: run(case["launch"], None))  # the file's own clipping, if any
        report["native"] = attempt(lambda: run(case["native"], case["clip"]))
        if os.environ.get("RANK", "0") == "0":
            (out / f"{name}.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
