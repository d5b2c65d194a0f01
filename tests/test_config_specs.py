"""The run config's views and derived values: `Config.policy_spec()` / `rollout_spec()` carry
exactly the keys their field docs name (what `megatron/` and `rollout/` read instead of the whole
`Config`), and the derived values are filled in once, by `resolve` (and `train.with_routes`),
without changing any section a caller holds."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from megatron_gspo.config import (
    Config,
    DataConfig,
    LaunchConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    WeightSyncConfig,
    load_config,
)
from megatron_gspo.config_io import field_docs

REQUIRED = ["model.hf_path=/m", "data.train_path=/d.jsonl"]
# Values unlike each other and unlike the defaults, so that a field wired to the wrong key shows.
DISTINCT = [
    "train.seed=11",
    "train.steps=13",
    "train.micro_batch_tokens=5000",
    "train.routing_flip_every=7",
    "train.routing_flip_per_minibatch=true",
    "rl.mini_batches_per_rollout=2",
    "rl.prompts_per_rollout=6",
    "rl.group_size=3",
    "rl.adv_eps=0.003",
    "rl.normalize_std=false",
    "rl.pi_old=recompute",
    "rollout.temperature=0.7",
    "loss.mask_truncated=true",
    "logging.dir=/runs/z",
    "model.tokenizer_path=/tok",
]
# Fields computed from several keys; checked by name below.
DERIVED = {"optimizer_steps", "offload_trainer"}


def _cfg(*overrides: str) -> Config:
    return load_config(None, [*REQUIRED, *overrides])


def _value(cfg: Config, key: str) -> Any:
    out: Any = cfg
    for part in key.split("."):
        out = getattr(out, part)
    return out


@pytest.mark.parametrize("build", ["policy_spec", "rollout_spec"])
def test_each_spec_field_is_the_key_its_doc_names(build: str) -> None:
    cfg = _cfg(*DISTINCT)
    spec = getattr(cfg, build)()
    for name, doc in field_docs(type(spec)).items():
        if key := re.match(r"([a-z_]+\.[a-z_]+): ", doc):
            assert getattr(spec, name) == _value(cfg, key.group(1)), name
        elif section := re.match(r"The `([a-z]+):` section", doc):
            assert getattr(spec, name) is getattr(cfg, section.group(1)), name
        else:
            assert name in DERIVED, f"{name}: its doc names no key ({doc[:40]!r})"


def test_derived_spec_fields() -> None:
    assert _cfg(*DISTINCT).policy_spec().optimizer_steps == 13 * 2
    colocated = _cfg("rollout.launch.colocated=true")
    assert colocated.policy_spec().offload_trainer
    off = _cfg("rollout.launch.colocated=true", "rollout.launch.offload_trainer=false")
    assert not off.policy_spec().offload_trainer
    assert not _cfg().policy_spec().offload_trainer  # not colocated


def test_a_config_does_not_change_the_sections_it_is_given() -> None:
    """Was: `Config.__post_init__` wrote weights.engine_ep_size, weights.disk_dir,
    weights.dtype and rollout.launch.model_path into the sections passed in."""
    weights = WeightSyncConfig(transport="disk")
    launch = LaunchConfig(ep_size=2)
    Config(
        model=ModelConfig(hf_path="/m", dtype="bf16"),
        data=DataConfig(train_path="/d.jsonl"),
        rollout=RolloutConfig(launch=launch),
        weights=weights,
        logging=LoggingConfig(dir="/runs/x"),
    )
    assert (weights.disk_dir, weights.engine_ep_size, weights.dtype) == (None, 1, None)
    assert (weights.engine_device, launch.model_path) == ("auto", "")


def test_resolve_fills_the_derived_values_into_a_new_config() -> None:
    from megatron_gspo.config import resolve

    raw = Config(
        model=ModelConfig(hf_path="/m", dtype="bf16"),
        data=DataConfig(train_path="/d.jsonl"),
        rollout=RolloutConfig(launch=LaunchConfig(ep_size=2)),
        weights=WeightSyncConfig(transport="disk"),
        logging=LoggingConfig(dir="/runs/x"),
    )
    before = raw.to_dict()
    out = resolve(raw)
    assert raw.to_dict() == before
    w = out.weights
    assert (w.disk_dir, w.engine_ep_size, w.dtype) == ("/runs/x/weights", 2, "float32")
    assert (w.engine_device, out.rollout.launch.model_path) == ("cpu", "/m")
    assert resolve(out) == out  # once is enough: what it fills it keeps
    loaded = _cfg("model.dtype=bf16", "rollout.launch.ep_size=2", "weights.transport=disk",
                  "logging.dir=/runs/x")  # fmt: skip
    assert loaded == out  # load_config applies it
    # SGLang's own layout is auto's choice for the tensor transport, but an embedded engine
    # of TP 2 holds whole HF tensors: auto is hf for it (engine layout otherwise)
    for tp, layout in ((1, "engine"), (2, "hf")):
        got = resolve(_cfg(f"rollout.launch.tp_size={tp}")).weights
        assert got.resolved_layout == layout, tp


def test_routes_come_in_a_new_config(tmp_path: Path) -> None:
    """rl.routing_replay: the engines' flag and the client's request for routes, in a new
    Config (was: written into cfg.rollout by train.main after preflight)."""
    from megatron_gspo.engines.routed_experts import SERVER_FLAG
    from megatron_gspo.train import with_routes

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "num_experts_per_tok": 2, "num_experts": 4})
    )
    cfg = _cfg(f"model.hf_path={tmp_path}", "rl.routing_replay=true")
    before = cfg.to_dict()
    out = with_routes(cfg)
    assert cfg.to_dict() == before
    assert out.rollout.launch is not None and SERVER_FLAG in out.rollout.launch.extra_args
    assert out.rollout.client.return_routed_experts
    assert out.rollout.client.num_experts_per_tok == 2
    assert with_routes(_cfg()) == _cfg()  # off: the same run


def test_the_scheduler_takes_its_fields_from_the_rollout_section() -> None:
    """`SchedulerConfig.from_rollout`: each field from the `rollout:` key of its name (one field
    list, the scheduler's), `prompts` and `group_size` as given."""
    from megatron_gspo.rollout.groups import SchedulerConfig

    cfg = _cfg(
        "rollout.max_new_tokens=77",
        "rollout.oversample=1.5",
        "rollout.drop_equal_reward_groups=true",
        "rollout.partial_tokens=9",
        "rollout.max_staleness=2",
        "rollout.fill_attempts=5",
        "rollout.max_continuation_retries=6",
    )
    got = SchedulerConfig.from_rollout(cfg.rollout, prompts=6, group_size=3)
    assert got == SchedulerConfig(
        prompts=6,
        group_size=3,
        max_new_tokens=77,
        oversample=1.5,
        drop_equal_reward_groups=True,
        partial_tokens=9,
        max_staleness=2,
        fill_attempts=5,
        max_continuation_retries=6,
    )
