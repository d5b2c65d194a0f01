"""Issue 26 (7): config input is never silently changed and never crashes with a parser
traceback: a key given twice in the YAML is an error naming both lines (was: a second `optim:`
block silently reset optim.lr from 3e-3 to 1e-6), and a `--set` value that is not valid YAML is
the literal string for a string field or one line naming the override otherwise (was: a raw
`yaml.scanner.ScannerError` traceback from every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import load_config
from megatron_gspo.config_io import ConfigError
from tests.test_bad_input import _base, _write


def _yaml_with(tmp: Path, extra: str) -> Path:
    path = _write(tmp, _base(tmp))
    path.write_text(path.read_text() + extra)
    return path


@pytest.mark.parametrize(
    "extra, key",
    [
        ("optim:\n  lr: 0.003\noptim:\n  lr: 1.0e-06\n", "optim"),  # two sections
        ("optim:\n  lr: 0.003\n  lr: 1.0e-06\n", "lr"),  # one key twice in a section
    ],
    ids=["section", "key"],
)
def test_a_duplicate_yaml_key_is_an_error_naming_both_lines(tmp_path: Path, extra, key) -> None:
    path = _yaml_with(tmp_path, extra)
    lines = path.read_text().splitlines()
    want = [i + 1 for i, line in enumerate(lines) if line.strip().startswith(f"{key}:")][-2:]
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == 1e-6  # what PyYAML alone does
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}:{want[1]}: duplicate key '{key}' (first at line {want[0]})")


def test_set_values_that_are_not_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, _base(tmp_path))
    text = "[Important] Answer briefly"
    cfg = load_config(path, [f"data.system_prompt={text}"])  # a str field: the text as given
    assert cfg.data.system_prompt == text
    cfg = load_config(path, ["data.system_prompt=[Important]"])  # parses as a list: the text
    assert cfg.data.system_prompt == "[Important]"
    for bad in ("optim.lr=[1e-3", "rollout.client.engine_urls=[http://a:1, http://b:2"):
        with pytest.raises(ConfigError) as e:
            load_config(path, [bad])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"--set {bad}: "), msg
        assert "is not a YAML value" in msg
