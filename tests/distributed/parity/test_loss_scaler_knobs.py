"""fp16 loss scaling with DeepSpeed's knobs: a DeepSpeed config's ``fp16`` section scales the loss as
DeepSpeed's own scaler does, step by step; the settings reach training through an adapter; users who set
nothing keep torch GradScaler's values; bad values are refused with what to use."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.rank_pool import run_distributed
from zero_core import ZeroConfig
from zero_core.checkpoint.checkpoint_records import EngineRecord, parse_engine_record
from zero_core.deepspeed import from_deepspeed
from zero_core.engine_plans import LossScaling
from zero_core.optim.loss_scaling import LossScaler, LossScalerState, state_from_checkpoint

# 40 steps: O an overflow, . a clean step. Consecutive overflows, clean runs longer than the windows below
# (so the scale grows, more than once), lone overflows between growths.
PATTERN = "..O.OO......O.OOO.........O..O.......OO."

# fp16 sections, each against DeepSpeed's scaler built from the same section.
SECTIONS = {
    "deepspeed's defaults (hysteresis 2, window 1000)": {},
    "hysteresis 2, window 3": {"loss_scale_window": 3, "hysteresis": 2},
    "hysteresis 2, consecutive": {"loss_scale_window": 3, "hysteresis": 2, "consecutive_hysteresis": True},
    "no hysteresis, window 4, from 2**10": {"loss_scale_window": 4, "hysteresis": 1, "initial_scale_power": 10},
    "hysteresis 3, consecutive": {"loss_scale_window": 5, "hysteresis": 3, "consecutive_hysteresis": True},
    "hysteresis 2, floor held, then an overflow at it": {
        "loss_scale_window": 8,
        "hysteresis": 2,
        "initial_scale_power": 9,
        "min_loss_scale": 100,
    },  # fmt: skip
    "hysteresis 1, floor": {"loss_scale_window": 6, "hysteresis": 1, "initial_scale_power": 8, "min_loss_scale": 32},
    "static 128": {"loss_scale": 128, "hysteresis": 2},
}


def _ours(section: dict) -> LossScaler:
    settings = from_deepspeed({"zero_optimization": {"stage": 1}, "fp16": {"enabled": True, **section}}).settings
    return LossScaler(LossScaling.of(ZeroConfig(**settings)))


def _deepspeeds(section: dict, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The scaler DeepSpeed's ZeRO optimizers make from this section (stage_1_and_2.py and stage3.py:
    ``CreateLossScaler`` with the engine's ``dynamic_loss_scale_args()``)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16 import loss_scaler
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *args, **kwargs: 0)  # it only logs on rank 0
    config = DeepSpeedFP16Config(enabled=True, **section)
    return loss_scaler.CreateLossScaler(
        dtype=torch.float16,
        static_loss_scale=config.loss_scale,
        dynamic_scaling=config.loss_scale == 0,
        dynamic_loss_args=config.dynamic_loss_scale_args(),
    )


def _scales(update, scale, pattern: str) -> list[float | str]:  # type: ignore[no-untyped-def]
    """The scale after each step, until an update raises ("stopped")."""
    after = []
    for step in pattern:
        try:
            update(step == "O")
        except Exception:  # DeepSpeed raises a bare Exception at its floor, ours a FloatingPointError
            after.append("stopped")
            break
        after.append(scale())
    return after


@pytest.mark.parametrize("section", SECTIONS.values(), ids=SECTIONS.keys())
def test_a_deepspeed_fp16_section_scales_as_deepspeeds_own_scaler_step_by_step(
    section: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = _ours(section), _deepspeeds(section, monkeypatch)
    pattern = PATTERN + "." * 2100 if not section else PATTERN  # DeepSpeed's window of 1000: two growths
    expected = _scales(theirs.update_scale, lambda: float(theirs.cur_scale), pattern)
    assert _scales(ours.update, lambda: ours.scale, pattern) == expected
    assert (len(set(expected)) == 1) == bool(section.get("loss_scale"))  # the scale moved, a static one did not
    if section.get("min_loss_scale"):
        assert expected[-1] == "stopped"  # an overflow at the floor stops the run, here as there
    assert ours.state.skipped_steps == pattern[: len(expected)].count("O") - (expected[-1] == "stopped")


def test_the_floor_and_the_growth_as_deepspeed_counts_them() -> None:
    """What the comparison above covers, said outright for the reader: the first doubling comes on the clean
    step after ``loss_scale_window`` clean ones, then every window; hysteresis 2 keeps the scale on the first
    overflow; the floor holds, and an overflow at it stops the run."""
    scaler = LossScaler(
        LossScaling.of(ZeroConfig(loss_scale_window=2, loss_scale_hysteresis=2, min_loss_scale=2.0**14))
    )
    after = _scales(scaler.update, lambda: scaler.scale, "...O.O..O.O.O")
    assert after == [2**16, 2**16, 2**17, 2**17, 2**17, 2**16, 2**16, 2**16, 2**15, 2**15, 2**14, 2**14, "stopped"]


def test_users_who_set_nothing_keep_torch_gradscalers_values() -> None:
    defaults = ZeroConfig()
    assert (defaults.loss_scale, defaults.initial_loss_scale, defaults.loss_scale_window) == (0, 2.0**16, 2000)
    assert (defaults.loss_scale_hysteresis, defaults.consecutive_hysteresis, defaults.min_loss_scale) == (1, False, 0)
    scaler = LossScaler(LossScaling.of(defaults))
    halved = _scales(scaler.update, lambda: scaler.scale, "O" * 40)  # each overflow halves it, no floor
    assert halved == [2.0 ** (16 - n) for n in range(1, 41)]


def test_settings_and_deepspeed_keys_are_refused_with_what_to_use() -> None:
    with pytest.raises(ValueError) as refused:
        ZeroConfig(loss_scale=-1, loss_scale_window=0, loss_scale_hysteresis=0, min_loss_scale=float("nan"))
    message = str(refused.value)
    assert message.startswith("ZeroConfig.loss_scale=-1: use 0 (dynamic loss scaling) or a fixed scale > 0; ")
    for expected in (
        "ZeroConfig.loss_scale_window=0: use an integer >= 1 (the default is 2000)",
        "ZeroConfig.loss_scale_hysteresis=0: use an integer >= 1 (1: every overflow halves the scale",
        "ZeroConfig.min_loss_scale=nan: use a number >= 0 (0: no floor)",
    ):
        assert expected in message
    with pytest.raises(ValueError) as refused:
        from_deepspeed(
            {
                "zero_optimization": {"stage": 3},
                "fp16": {
                    "enabled": True, "loss_scale_window": -5, "hysteresis": "auto", "min_loss_scale": 0,
                    "initial_scale_power": 16.5, "fp16_master_weights_and_grads": True, "loss_scael": 1,
                },
                "bf16": {"enabled": False, "bf16_optimizer_states": True},
            }
        )  # fmt: skip
    message = str(refused.value)
    for expected in (
        "fp16.loss_scale_window=-5 (an integer >= 1)",
        "fp16.hysteresis='auto' (an integer >= 1; with 0 or less DeepSpeed never lowers the scale; \"auto\" is for "
        "fp16.enabled only)",
        "fp16.min_loss_scale=0 (a number > 0, as DeepSpeed takes it)",
        "fp16.initial_scale_power=16.5 (an integer: the first scale is 2**it)",
        "fp16.fp16_master_weights_and_grads=True (master weights and their gradients are fp32 here)",
        "fp16.loss_scael=1 (not a DeepSpeed key; did you mean 'loss_scale'?)",
        "bf16.bf16_optimizer_states=True (the optimizer state is fp32 here, as its master weights)",
    ):
        assert expected in message
    assert message.startswith("the DeepSpeed config: 7 key(s) cannot be honoured here")


def test_which_fp16_sections_set_the_scaler() -> None:
    def scaler_settings(config: dict) -> dict:
        settings = from_deepspeed({"zero_optimization": {"stage": 2}, **config}).settings
        return {k: v for k, v in settings.items() if k not in ("stage", "skip_nonfinite_steps")}

    deepspeeds = {
        "loss_scale": 0.0, "initial_loss_scale": 2.0**16, "loss_scale_window": 1000, "loss_scale_hysteresis": 2,
        "consecutive_hysteresis": False, "min_loss_scale": 1.0,
    }  # fmt: skip
    assert scaler_settings({"fp16": {"enabled": True}}) == deepspeeds  # DeepSpeed's defaults, as it would run
    # "auto": the framework's flag decides; if it says fp16, DeepSpeed's scaler. A config Hugging Face ships:
    hugging_face = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                    "hysteresis": 2, "min_loss_scale": 1}  # fmt: skip
    assert scaler_settings({"fp16": hugging_face}) == deepspeeds
    assert scaler_settings({"fp16": {"enabled": True, "loss_scale": 512, "auto_cast": True}})["loss_scale"] == 512.0
    # Off: DeepSpeed reads nothing else from the section, and neither do we (the keys are still known ones).
    assert scaler_settings({"fp16": {**hugging_face, "enabled": False}, "bf16": {"enabled": True}}) == {}
    assert scaler_settings({"bf16": {"enabled": True, "immediate_grad_update": True}}) == {}
    assert from_deepspeed({"fp16": {"enabled": True, "auto_cast": False}}, stage_given=True).without_effect == {
        "fp16.auto_cast": "floating inputs are always cast to the compute dtype (a script that runs without it "
        "passes fp16 already)"
    }


def test_the_adapters_take_the_settings_from_a_deepspeed_config() -> None:
    from accelerate_zero import ZeroPlugin
    from lightning_zero import ZeroStrategy

    config = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "hysteresis": 3, "loss_scale_window": 7}}
    plugin = ZeroPlugin.from_deepspeed(config)
    assert (plugin.loss_scale_hysteresis, plugin.loss_scale_window, plugin.min_loss_scale) == (3, 7, 1.0)
    assert plugin.environment()["ACCELERATE_ZERO_LOSS_SCALE_HYSTERESIS"] == "3"  # to the launched processes
    strategy = ZeroStrategy(config=config)
    assert (strategy.zero_config.loss_scale_hysteresis, strategy.zero_config.loss_scale_window) == (3, 7)
    with pytest.raises(ValueError, match="loss_scale_hysteresis=2 against the config's 3"):
        ZeroStrategy(config=config, loss_scale_hysteresis=2)


def test_the_scaler_state_a_checkpoint_keeps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The hysteresis spent is saved with the scale and the clean steps; a checkpoint saved before it existed
    still loads (its counter counts on as the clean steps); anything else is refused by name."""
    scaler = LossScaler(LossScaling.of(ZeroConfig(loss_scale_hysteresis=3, loss_scale_window=4)))
    for found_inf in (False, False, True, False, True):
        scaler.update(found_inf)
    record = EngineRecord(stage=3, world_size=2, steps=5, loss_scaler=scaler.state, save_id="s")
    _, parsed = parse_engine_record({"zero": record.to_dict()}, tmp_path / "meta.pt", "s")
    assert parsed.loss_scaler == scaler.state == LossScalerState(2.0**16, 0, 2, overflows_absorbed=2)
    older = {"scale": 1024.0, "steps_since_backoff": 5, "skipped_steps": 1}
    assert state_from_checkpoint(older) == LossScalerState(1024.0, clean_steps=5, skipped_steps=1)
    for bad in ({**older, "code": 1}, {**vars(scaler.state), "overflows_absorbed": -1}, {**older, "scale": 0}):
        with pytest.raises(ValueError, match="the loss-scaler state is malformed"):
            state_from_checkpoint(bad)


def test_skipped_steps_say_what_happened_to_the_scale(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="zero_core")
    dynamic = LossScaler(LossScaling.of(ZeroConfig(loss_scale_hysteresis=2)), announce=True)
    dynamic.update(True)
    dynamic.update(True)
    static = LossScaler(LossScaling.of(ZeroConfig(loss_scale=64)), announce=True)
    static.update(True)
    assert [record.getMessage() for record in caplog.records] == [
        "ZeRO fp16: gradient overflow, optimizer step skipped (1 so far); loss scale 65536 kept (hysteresis: the "
        "next overflow halves it)",
        "ZeRO fp16: gradient overflow, optimizer step skipped (2 so far); loss scale 65536 -> 32768",
        "ZeRO fp16: gradient overflow, optimizer step skipped (1 so far); loss scale 64 (static)",
    ]


# ------------------------------------------------------------------------------------ training, end to end
OVERFLOWS = (1, 2)  # the batches whose loss is multiplied by inf


def _fit_with_overflows(fp16: dict) -> dict[str, list]:
    """Trainer, ZeroStrategy(config=...) with this fp16 section, fp16 compute (on a CPU Lightning needs the
    plugin for it), overflows injected in ``OVERFLOWS``: per step the loss scale after it and whether the
    weights moved."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroPrecision, ZeroStrategy
    from tests.lightning_module import TinyLM

    class Overflowing(TinyLM):
        def training_step(self, ids: torch.Tensor, batch_index: int) -> torch.Tensor:
            loss = super().training_step(ids, batch_index)
            return loss * float("inf") if batch_index in OVERFLOWS else loss

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.scales, self.moved, self.before = [], [], None

        def on_train_batch_start(self, trainer, module, batch, batch_index) -> None:  # type: ignore[no-untyped-def]
            self.before = trainer.strategy.engine.full_state_dict()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_index) -> None:  # type: ignore[no-untyped-def]
            after = trainer.strategy.engine.full_state_dict()
            self.moved.append(any(not torch.equal(after[k], self.before[k]) for k in after))
            self.scales.append(trainer.strategy.engine.loss_scale)

    torch.manual_seed(0)
    record = Record()
    config = {"zero_optimization": {"stage": 2}, "fp16": fp16}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=ZeroStrategy(config=config), plugins=[ZeroPrecision("16-mixed")],
        max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record],
    )  # fmt: skip
    trainer.fit(Overflowing(batchnorm=False, dataset_size=32))
    return {"scales": record.scales, "moved": record.moved}


def _training_runs(rank: int, world_size: int) -> dict[str, dict]:
    return {
        "hysteresis 2": _fit_with_overflows(
            {"enabled": True, "hysteresis": 2, "loss_scale_window": 100, "initial_scale_power": 10}
        ),
        "static": _fit_with_overflows({"enabled": True, "loss_scale": 1024}),
    }


def test_the_fp16_section_drives_training_under_the_trainer() -> None:
    """Two overflows in a row (steps 1 and 2): with DeepSpeed's hysteresis 2 the first only skips its step, the
    second halves the scale too; a static scale skips both (DeepSpeed's ZeRO optimizers check the gradients
    themselves and skip the step whatever the scaler) and never moves. The dynamic scale starts at 2**10: this
    model's first fp16 step overflows at DeepSpeed's 2**16."""
    (runs,) = run_distributed(_training_runs, 1)
    skipped = [step in OVERFLOWS for step in range(5)]
    assert runs["hysteresis 2"]["moved"] == runs["static"]["moved"] == [not s for s in skipped]
    assert runs["hysteresis 2"]["scales"] == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9]
    assert runs["static"]["scales"] == [1024.0] * 5
