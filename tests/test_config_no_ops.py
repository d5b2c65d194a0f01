"""No silent no-ops (issue 40): every int and float key of the config at 0 and -1, and every key
another key switches off, is either refused in one line naming the key or documented to do
what it does. The keys come from `python -m megatron_gspo.config --keys` (what a user sees),
cross-checked against a walk of the dataclasses (sections that are null by default included).

* Zero and negative: a key that accepts 0 (or -1) must say in its docstring what that value
  does (`0: off`, `0 = never`, `-1 (off)`, ...) or be in `ORDINARY`, the keys for which 0 is
  an ordinary point of the range (a coefficient, a seed, a rank), each with its reason. Was:
  `rollout.client.max_batch_per_request=0`, `request_timeout_s=0`, `weights.disk_keep=0`,
  `rollout.launch.startup_timeout_s=-1`, a negative port, ... accepted: 14 keys failed here
  on the code before (and negative seeds, which numpy refuses later, were accepted).
* Switched off: each row of `config_inert.INERT` is refused with its switch off and accepted
  with it on; every key whose docstring names a condition on another key (`(rollout.env
  only)`, `(optim.optimizer=sgd)`) has a row. Was: `optim.sgd_momentum` with adam,
  `rollout.max_turns` without an env, `eval.temperature` with evaluation off, ... accepted and
  ignored: 25 of the rows failed here on the code before (the others were refused already by
  their section's own check, e.g. `checkpoint.save_every` without `checkpoint.dir`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from megatron_gspo.config import Config, config_from_dict
from megatron_gspo.config_inert import INERT, key_default
from megatron_gspo.config_io import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BASE: dict[str, Any] = {
    "model": {"hf_path": "/m"},
    "data": {"train_path": "/d.jsonl"},
    "reward": {"kind": "toy"},
    "rollout": {"launch": {"model_path": "/m"}},
}
# What turns each switched-off key on (with the base above), so that a value refused while
# switched off is accepted once it is on: the refusal is the switch's, not the value's.
SWITCH_ON: dict[str, dict[str, Any]] = {
    "optim.optimizer=sgd": {"optim.optimizer": "sgd"},
    "optim.optimizer=adam": {},
    "optim.lr_schedule": {"optim.lr_schedule": "cosine"},
    "loss.kl_coef": {"loss.kl_coef": 0.1},
    "loss.tis_mode": {"loss.tis_mode": "sequence", "rl.pi_old": "recompute"},
    "reward.overlong_buffer": {"reward.overlong_buffer": 4},
    "reward.kind=http": {"reward.kind": "http", "reward.url": "http://127.0.0.1:1/score"},
    "checkpoint.dir": {"checkpoint.dir": "/tmp/ckpt"},
    "eval.every": {"eval.every": 2, "eval.path": "/e.jsonl", "eval.temperature": 1.0},
    "rollout.async_rollout": {"rollout.async_rollout": True},
    "rollout.partial_tokens": {"rollout.partial_tokens": 64},
    "rollout.env": {"rollout.env": "megatron_gspo.envs.calculator:Calculator"},
    "rollout.agent": {"rollout.agent": "m:f"},
    "weights.transport=disk": {"weights.transport": "disk", "weights.disk_dir": "/tmp/w"},
}
ORDINARY: dict[str, str] = {
    "data.seed": "a seed",
    "train.seed": "a seed",
    "optim.min_lr": "a learning-rate floor: 0 decays to 0",
    "optim.warmup_steps": "the length of the warmup: 0 steps is none",
    "optim.weight_decay": "a coefficient: 0 is no decay",
    "optim.adam_beta1": "Adam's moment coefficients are in [0, 1)",
    "optim.adam_beta2": "Adam's moment coefficients are in [0, 1)",
    "optim.sgd_momentum": "a coefficient: 0 is plain SGD",
    "loss.eps_low": "a clip half-width: 0 clips every ratio away from 1",
    "loss.eps_high": "a clip half-width: 0 clips every ratio away from 1",
    "rollout.launch.base_gpu_id": "a GPU index",
    "rollout.client.max_retries": "a count of re-sends: 0 is none",
    "rollout.client.backoff_s": "a delay: 0 is none",
    "rollout.client.backoff_max_s": "a delay: 0 is none",
    "rollout.client.engine_cooldown_s": "a delay: 0 is none",
    "rollout.client.num_experts_per_tok": "its default; the job fills it in",
    "rollout.max_staleness": "a lag in versions: 0 is on-policy only",
    "rollout.max_continuation_retries": "a count of retries: 0 is none",
    "weights.sender_rank": "a rank",
    "reward.retries": "a count of retries: 0 is none",
    "reward.overlong_penalty": "a coefficient: 0 scores overlong answers like the others",
    "eval.pass_threshold": "a reward level; rewards may be 0 or negative",
}
# A value other than the default that the key accepts where it is switched on.
OTHER: dict[str, Any] = {
    "optim.min_lr": 1e-7,
    "optim.adam_beta1": 0.5,
    "optim.adam_beta2": 0.5,
    "optim.sgd_momentum": 0.5,
    "optim.adam_eps": 1e-6,
    "loss.kl_estimator": "k1",
    "reward.api_key_env": "MY_KEY",
    "rollout.turn_stop": ["</x>"],
    "rollout.max_total_tokens": 512,
    "checkpoint.keep_last": 2,
    "eval.max_new_tokens": 16,
}
# Keys that name a switch in their docstring but are accepted with it off, with the reason.
UNREFUSED_SWITCHES: dict[str, str] = {
    "rollout.launch.router_port": "the planner and the Slurm scripts pin every port of a "
    "launch (free ones per job), router or not",
}
SAYS_ZERO = re.compile(r"(?<![\w.])0\s*(:|=|\)| disables| runs| returns| means)")
SAYS_MINUS_ONE = re.compile(r"-1\s*(\(off\)|:|=)")


def _keys_from_cli() -> dict[str, str]:
    """`python -m megatron_gspo.config --keys`: key -> docstring."""
    out = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.config", "--keys"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    return {
        lines[i].split(" = ")[0]: lines[i + 1].strip()
        for i in range(0, len(lines) - 1)
        if " = " in lines[i] and not lines[i].startswith(" ")
    }


def _numeric_keys(cls: type = Config, prefix: str = "") -> dict[str, type]:
    """Every int or float key of the dataclass tree (optional sections included)."""
    found: dict[str, type] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp, key = hints[f.name], f"{prefix}{f.name}"
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        for arm in typing.get_args(tp) if union else (tp,):
            if dataclasses.is_dataclass(arm):
                found |= _numeric_keys(arm, f"{key}.")  # type: ignore[arg-type]
            elif arm in (int, float) and tp is not bool:
                found[key] = arm
    return found


DOCS = _keys_from_cli()
NUMERIC = _numeric_keys()


def _build(over: dict[str, Any]) -> Config:
    data = copy.deepcopy(BASE)
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        node = data
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[name] = value
    return config_from_dict(data)


def _switch_for(key: str) -> dict[str, Any]:
    (row,) = [r for r in INERT if r.key == key]
    (name,) = [s for s in SWITCH_ON if row.unless.startswith(s)]
    return SWITCH_ON[name]


def test_the_cli_lists_every_numeric_key() -> None:
    assert set(NUMERIC) <= set(DOCS), sorted(set(NUMERIC) - set(DOCS))
    assert len(NUMERIC) > 90, len(NUMERIC)


@pytest.mark.parametrize("key", sorted(NUMERIC))
def test_zero_and_minus_one_are_refused_or_documented(key: str) -> None:
    """Where the key is switched on (a value refused for its switch says nothing of 0)."""
    on = _switch_for(key) if key in {r.key for r in INERT} else {}
    cast = NUMERIC[key]
    for value, says in ((cast(0), SAYS_ZERO), (cast(-1), SAYS_MINUS_ONE)):
        try:
            _build(on | {key: value})
        except ConfigError as e:
            assert "\n" not in str(e) and key in str(e), (value, str(e))
            continue
        assert key in ORDINARY or says.search(DOCS[key]), (
            f"{key}={value} is accepted, but its docstring does not say what it does: "
            f"{DOCS[key]!r}; refuse it in the section's __post_init__ or document it"
        )


@pytest.mark.parametrize("row", INERT, ids=[r.key for r in INERT])
def test_a_switched_off_key_is_refused_and_accepted_once_on(row: Any) -> None:
    on = _switch_for(row.key)
    default = key_default(_build(on), row.key)
    if row.key in OTHER:
        value = OTHER[row.key]
    else:
        value = not default if isinstance(default, bool) else (default or 0) + 1
    with pytest.raises(ConfigError) as e:
        _build({row.key: value} | ({} if on else {"optim.optimizer": "sgd"}))
    msg = str(e.value)  # the row's line, or the section's own check where it has one
    assert "\n" not in msg and row.key in msg, msg
    _build(on | {row.key: value})  # accepted where it takes effect


def test_every_documented_switch_has_a_row() -> None:
    """A docstring that names a condition on another key, `(rollout.env only)` or
    `(optim.optimizer=sgd)`, is a key that can be switched off: it needs an INERT row."""
    condition = re.compile(r"\((?:[a-z_]+\.)+[a-z_]+(?:=\w+)?(?: only)?\)")
    rows = {r.key for r in INERT} | set(UNREFUSED_SWITCHES)
    named = {k for k, doc in DOCS.items() if condition.search(doc)}
    missing = sorted(k for k in named - rows if not condition.search(DOCS[k]).group(0)[1:-1]
                     .startswith(k))  # fmt: skip
    assert not missing, missing
    assert rows <= set(DOCS), sorted(rows - set(DOCS))
