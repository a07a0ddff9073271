"""Accelerate's DeepSpeed config templates (the corpus' accelerate_zero_stage*_config.json: fp16, AdamW and
WarmupDecayLR with "auto"s, gradient_clipping "auto"), each trained unedited by a script written for Accelerate's
DeepSpeed integration (DummyOptim, DummyScheduler), beside the same run written our way: ZeroPlugin with the
settings the file means, torch's AdamW, WarmupDecayLR built by hand (stepped once per optimizer step that was not
skipped, as DeepSpeed's engine steps it) and accelerator.clip_grad_norm_(..., 1.0) in the loop ("auto" clipping
is 1.0 under Accelerate). Rank 0 writes OUT/<file stem>.json with both runs' losses, rates and final weights.

    ACCELERATE_USE_CPU=1 accelerate-zero launch --zero_config_file CONFIG --multi_gpu --num_processes 2 \\
        tests/scripts/deepspeed_corpus_accelerate.py OUT CONFIG [CONFIG ...]

The launcher reads the first CONFIG. One launch costs seconds of imports, so each further CONFIG is read here by
the launcher's own reading (``plugin_from_arguments``) into the variables the launcher would have set; the report
says whether that reading of the first CONFIG gives exactly the variables the launcher set.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from accelerate_zero import ZeroAccelerator, ZeroPlugin  # noqa: E402
from accelerate_zero.launch import plugin_from_arguments  # noqa: E402
from accelerate_zero.plugin import ENV_PREFIX  # noqa: E402
from tests.scripts.accelerate_deepspeed_sections import train  # noqa: E402

STEPS = 10  # not the sections script's 6: fp16 overflows skip the first steps, and at least 3 must train
PRECISION_VARIABLE = "ACCELERATE_MIXED_PRECISION"
# What each template's zero_optimization section means, written our way.
NATIVE = {
    "accelerate_zero_stage1_config": dict(stage=1),
    "accelerate_zero_stage2_config": dict(stage=2),
    "accelerate_zero_stage2_offload_config": dict(stage=2, offload_optimizer="cpu"),
    "accelerate_zero_stage3_config": dict(stage=3),
    "accelerate_zero_stage3_offload_config": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
}
# What their fp16 section means (loss_scale 0, initial_scale_power 16: our defaults already): precision.py.
FP16_SCALING = dict(loss_scale_window=1000, loss_scale_hysteresis=2, min_loss_scale=1.0)


def launcher_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX) or k == PRECISION_VARIABLE}


def read_as_the_launcher(config: Path) -> dict[str, str]:
    """Set the variables ``accelerate-zero launch --zero_config_file CONFIG`` sets for its processes."""
    plugin, launch_args = plugin_from_arguments(["--zero_config_file", str(config), "--multi_gpu", "train.py"])
    os.environ.update(plugin.environment())
    os.environ[PRECISION_VARIABLE] = launch_args.mixed_precision  # Accelerate's launcher hands it on so
    return launcher_variables()


def fresh_state() -> None:
    AcceleratorState._reset_state()  # a new Accelerator's own settings, as accelerate_train.py's cases do
    GradientState._reset_state()


def main() -> None:
    out, configs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    torch.set_num_threads(1)
    launched = launcher_variables()
    for index, config in enumerate(configs):
        report = {}
        variables = read_as_the_launcher(config)
        if index == 0:
            report["reread_matches_launcher"] = variables == launched
        fresh_state()
        report["config"] = train(ZeroAccelerator(), by_hand=False, steps=STEPS)  # the launcher's settings and sections
        # The same written our way: nothing from the file (its variables cleared).
        for name in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
            del os.environ[name]
        fresh_state()
        plugin = ZeroPlugin(**NATIVE[config.stem], **FP16_SCALING)
        hand = ZeroAccelerator(zero_plugin=plugin, mixed_precision="fp16", step_scheduler_with_optimizer=False)
        report["hand"] = train(hand, by_hand=True, steps=STEPS)
        if hand.is_main_process:
            (out / f"{config.stem}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
