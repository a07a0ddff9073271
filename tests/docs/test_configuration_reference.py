"""The configuration reference is generated from the settings schema and committed as generated."""

from __future__ import annotations

from docs_tools.configuration import deepspeed_keys, reference
from tests.paths import ROOT
from zero_core import user_settings

GENERATED = ROOT / "docs" / "generated" / "configuration.md"
SETTINGS = {setting.name: setting for setting in user_settings()}


def test_the_committed_reference_is_the_generated_one() -> None:
    assert GENERATED.read_text() == reference(), (
        "docs/generated/configuration.md is stale: run `python -m docs_tools.configuration > "
        "docs/generated/configuration.md`"
    )


def test_every_setting_has_an_entry_with_each_spelling() -> None:
    text = reference()
    for setting in SETTINGS.values():
        entry = text[text.index(f"### `{setting.name}` {{ #{setting.name} }}") :].split("\n### ")[0]
        for spelling in (setting.text.name, setting.text.flag, f"ACCELERATE_ZERO_{setting.text.name.upper()}"):
            assert f"`{spelling}`" in entry, (setting.name, spelling)
        assert setting.values in entry and setting.values.strip()


def test_deepspeed_keys_are_the_mapped_ones() -> None:
    assert deepspeed_keys(SETTINGS["stage"]) == ["zero_optimization.stage"]
    assert deepspeed_keys(SETTINGS["offload_optimizer"]) == [
        "zero_optimization.cpu_offload",
        "zero_optimization.offload_optimizer.device",
    ]
    assert "zero_optimization.stage3_prefetch_bucket_size" in deepspeed_keys(SETTINGS["prefetch_cap_mb"])
    assert deepspeed_keys(SETTINGS["wrap_policy"]) == []
