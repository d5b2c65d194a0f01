"""Keys that another key switches off: set to anything but their default there, refused.

A key documented as taking effect only with another setting (`optim.sgd_momentum` with
`optim.optimizer=sgd`, `checkpoint.save_every` with a `checkpoint.dir`, the multi-turn keys with
`rollout.env`, ...) did nothing, silently, when that setting was absent: a user who tuned it
saw no change and no word why (issue 40, "no silent no-ops"). Each such pair is one `Inert`
row below; `check_inert_keys` (called by `Config.__post_init__`) refuses a key set away from
its default where its row says it has no effect, in one line naming both keys:

    optim.sgd_momentum=0.5 has no effect unless optim.optimizer=sgd; set optim.optimizer=sgd,
    or remove optim.sgd_momentum (its default is 0.9)

The default itself is always accepted (it is what an unset key holds). Standard library only:
the config and the planner load without torch. `tests/test_config_no_ops.py` walks every key of
the config (as `python -m megatron_gspo.config --keys` lists them) and each row here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_gspo.config_io import ConfigError

if TYPE_CHECKING:
    from megatron_gspo.config import Config

__all__ = ["INERT", "Inert", "check_inert_keys", "key_default", "key_value"]


@dataclasses.dataclass(frozen=True, slots=True)
class Inert:
    """`key` has an effect only where `active(cfg)`; `unless` says that condition in words."""

    key: str
    """The dotted key that may be switched off."""
    unless: str
    """What switches it on, as the message says it (`optim.optimizer=sgd`)."""
    active: Callable[[Config], bool]
    """Whether `key` takes effect in a whole `Config`."""


# One row per switch: what turns the keys on (as the message says it), that condition on a whole
# `Config`, and the keys it switches off.
_SWITCHES: tuple[tuple[str, Callable[[Config], bool], tuple[str, ...]], ...] = (
    ("optim.optimizer=sgd", lambda c: c.optim.optimizer == "sgd", ("optim.sgd_momentum",)),
    (
        "optim.optimizer=adam",
        lambda c: c.optim.optimizer == "adam",
        ("optim.adam_beta1", "optim.adam_beta2", "optim.adam_eps"),
    ),
    (
        "optim.lr_schedule=linear or cosine (constant never decays)",
        lambda c: c.optim.lr_schedule != "constant",
        ("optim.min_lr",),
    ),
    ("loss.kl_coef > 0", lambda c: c.loss.kl_coef > 0, ("loss.kl_estimator", "loss.kl_in_reward")),
    (
        "loss.kl_coef > 0 (no reference model without it)",
        lambda c: c.loss.kl_coef > 0,
        ("loss.ref_offload",),
    ),
    ("loss.tis_mode is not none", lambda c: c.loss.tis_mode != "none", ("loss.tis_cap",)),
    (
        "reward.overlong_buffer > 0",
        lambda c: c.reward.overlong_buffer > 0,
        ("reward.overlong_penalty",),
    ),
    (
        "reward.kind=http",
        lambda c: c.reward.kind == "http",
        ("reward.retries", "reward.api_key_env"),
    ),
    (
        "checkpoint.dir is set",
        lambda c: c.checkpoint.dir is not None,
        ("checkpoint.save_every", "checkpoint.keep_last"),
    ),
    (
        "checkpoint.dir is set (it writes <dir>/hf_final)",
        lambda c: c.checkpoint.dir is not None,
        ("checkpoint.export_hf_at_end",),
    ),
    (
        "eval.every > 0",
        lambda c: c.eval.every > 0,
        ("eval.samples_per_prompt", "eval.temperature", "eval.max_new_tokens",
         "eval.pass_threshold"),
    ),
    (
        "rollout.async_rollout=true or rollout.partial_tokens is set (else no token lags)",
        lambda c: c.rollout.async_rollout or c.rollout.partial_tokens is not None,
        ("rollout.max_staleness",),
    ),
    (
        "rollout.partial_tokens is set",
        lambda c: c.rollout.partial_tokens is not None,
        ("rollout.max_continuation_retries",),
    ),
    (
        "rollout.env is set",
        lambda c: c.rollout.env is not None,
        ("rollout.max_turns", "rollout.max_total_tokens", "rollout.turn_stop",
         "rollout.env_workers", "rollout.env_timeout_s"),
    ),
    (
        "rollout.agent is set",
        lambda c: c.rollout.agent is not None,
        ("rollout.agent_workers", "rollout.agent_timeout_s"),
    ),
    ("weights.transport=disk", lambda c: c.weights.transport == "disk", ("weights.disk_keep",)),
)

INERT: tuple[Inert, ...] = tuple(
    Inert(key, unless, active) for unless, active, keys in _SWITCHES for key in keys
)
"""Every key another key switches off, one row each (`_SWITCHES` unfolded)."""


def key_value(cfg: Config, key: str) -> Any:
    """The value of the dotted `key` in `cfg` (None below a section that is None)."""
    obj = cfg
    for part in key.split("."):
        if obj is None:
            return None
        obj = getattr(obj, part)
    return obj


def key_default(cfg: Config, key: str) -> Any:
    """The default of the dotted `key`: its field's default in the section that holds it."""
    section, _, name = key.rpartition(".")
    owner = key_value(cfg, section) if section else cfg
    (field,) = [f for f in dataclasses.fields(owner) if f.name == name]
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def check_inert_keys(cfg: Config) -> None:
    """Raise `ConfigError` for the first key of `INERT` that is set away from its default
    where it has no effect."""
    for row in INERT:
        section = key_value(cfg, row.key.rpartition(".")[0])
        if section is None:  # an optional section left out (rollout.launch: null)
            continue
        value = key_value(cfg, row.key)
        default = key_default(cfg, row.key)
        if value == default or row.active(cfg):
            continue
        raise ConfigError(
            f"{row.key}={value!r} has no effect unless {row.unless}; set that, or remove "
            f"{row.key} (its default is {default!r})"
        )
