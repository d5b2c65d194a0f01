"""The HF config the layout is checked against (`layout.HFConfig`): transformers' own config
classes and config.json (as a dict, or as attributes the way preflight and the planner read
it without transformers) give the same answers."""

from __future__ import annotations

import json
import types

import pytest
from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

from megatron_gspo.config_io import ConfigError
from megatron_gspo.layout import Layout, hf_value, num_experts

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


def _forms(cfg: object) -> list[object]:
    """`cfg`, its config.json as a dict, and that dict as attributes."""
    data = json.loads(cfg.to_json_string())
    return [cfg, data, types.SimpleNamespace(**data)]


@pytest.mark.parametrize(
    ("cfg", "experts"),
    [
        (Qwen3MoeConfig(**SMALL, num_experts=6), 6),  # Qwen: num_experts
        (MixtralConfig(**SMALL, num_local_experts=8), 8),  # Mixtral: num_local_experts
        (Qwen3Config(**SMALL), None),  # dense
    ],
)
def test_every_form_of_a_config_reads_the_same(cfg: object, experts: int | None) -> None:
    for form in _forms(cfg):
        assert num_experts(form) == experts, type(form)
        assert hf_value(form, "hidden_size") == 64
        assert hf_value(form, "no_such_key", "dflt") == "dflt"


def test_validate_refuses_alike_for_transformers_and_config_json() -> None:
    cfg = Qwen3MoeConfig(**SMALL, num_experts=6)
    for form in (cfg, types.SimpleNamespace(**json.loads(cfg.to_json_string()))):
        with pytest.raises(ConfigError, match=r"parallel.ep=4 does not divide .*num_experts=6"):
            Layout(ep=4).validate(4, form)
        with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide .*heads=2"):
            Layout(tp=4).validate(4, form)
        assert Layout(ep=2).validate(4, form) == 4
