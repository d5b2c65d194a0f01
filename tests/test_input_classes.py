"""Bad input by class (issue 40; docs/reliability.md "Input classes"): rules that cover every
key or every file of a kind, each proved by walking all of them, not by listed cases.

* Non-finite numbers: every float key of the config (found by walking the dataclass tree, so a
  key added later is covered) refuses inf, -inf and NaN in the YAML and in `--set` (was:
  `optim.lr=inf` accepted; the update made the weights non-finite, they were pushed and
  checkpointed, and the job blamed the engine).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import Config, load_config
from megatron_gspo.config_io import ConfigError
from tests.test_bad_input import _base, _write


def _float_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, bool]]:
    """Every dotted key whose type holds a float, with whether it is a list of them."""
    found: list[tuple[str, bool]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        arms = typing.get_args(tp) if union else (tp,)
        for arm in arms:
            if dataclasses.is_dataclass(arm):
                found += _float_keys(arm, f"{key}.")  # type: ignore[arg-type]
            elif arm is float:
                found.append((key, False))
            elif typing.get_origin(arm) is list and typing.get_args(arm)[0] is float:
                found.append((key, True))
    return found


FLOAT_KEYS = _float_keys()


def test_the_walk_finds_the_float_keys() -> None:
    keys = dict(FLOAT_KEYS)
    assert {"optim.lr", "optim.weight_decay", "loss.eps_low", "sandbox.max_cpu_s"} <= set(keys)
    assert len(keys) > 30, len(keys)


@pytest.mark.parametrize("key, is_list", FLOAT_KEYS, ids=[k for k, _ in FLOAT_KEYS])
def test_every_float_key_refuses_inf_and_nan(tmp_path: Path, key: str, is_list: bool) -> None:
    """`--set key=inf|-inf|nan` and the YAML's own `.inf` / `.nan`: one line naming the key."""
    path = _write(tmp_path, _base(tmp_path))
    for text in ("inf", "-inf", "nan", ".inf", "-.inf", ".nan"):
        value = f"[{text}]" if is_list else text
        with pytest.raises(ConfigError) as e:
            load_config(path, [f"{key}={value}"])
        msg = str(e.value)
        assert "\n" not in msg and key in msg, (text, msg)
    section, _, name = key.rpartition(".")
    data = _base(tmp_path)
    node = data
    for part in section.split("."):
        node = node.setdefault(part, {})
    node[name] = [float("inf")] if is_list else float("inf")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(_write(tmp_path, data, "file.yaml"))
    assert yaml.safe_load((tmp_path / "file.yaml").read_text())  # written as YAML's .inf
