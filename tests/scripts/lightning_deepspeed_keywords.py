"""What Lightning's own DeepSpeedStrategy (Trainer's and Fabric's) builds from keyword arguments: its config, and
the fp16 section its setup adds under precision 16-mixed. Run in a process of its own (it imports DeepSpeed).

    python lightning_deepspeed_keywords.py cases.json out.json

cases.json: a list of keyword dicts; out.json: one {"trainer", "fabric", "fp16"} per case.
"""

from __future__ import annotations

import json
import sys

from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy
from lightning.fabric.strategies.deepspeed import _format_precision_config
from lightning.pytorch.strategies import DeepSpeedStrategy

_FP16_KNOBS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "min_loss_scale": 1,
}


def built(keywords: dict) -> dict:
    trainer = DeepSpeedStrategy(**keywords).config
    fabric = FabricDeepSpeedStrategy(**keywords).config
    fp16_added: dict = {}
    _format_precision_config(fp16_added, "16-mixed", **{k: keywords.get(k, d) for k, d in _FP16_KNOBS.items()})
    return {"trainer": trainer, "fabric": fabric, "fp16": fp16_added["fp16"]}


if __name__ == "__main__":
    with open(sys.argv[1]) as cases, open(sys.argv[2], "w") as out:
        json.dump([built(keywords) for keywords in json.load(cases)], out)
