"""Issue 26 (5): the conversion tools' --force replaces only what the tool writes (was:
`shutil.rmtree` of the whole output directory, unrelated files included, and the refusal
without --force suggested --force for any non-empty directory). One process, no conversion:
the checks run before any work, and the removal is the one the tools call."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_gspo.weights import convert
from megatron_gspo.weights.convert import HF_OUTPUT, MEGATRON_OUTPUT, ConversionError


def _previous_hf_output(d: Path) -> None:
    d.mkdir(parents=True)
    for name in ("model-00000.safetensors", "model.safetensors.index.json", "config.json",
                 "tokenizer.json", "generation_config.json"):  # fmt: skip
        (d / name).write_text("old")


def _refused(*args) -> str:
    with pytest.raises(ConversionError) as e:
        convert._check_output(*args)
    return str(e.value)


def test_force_never_deletes_what_the_tool_did_not_write(tmp_path: Path) -> None:
    src, out = tmp_path / "ckpt", tmp_path / "hf"
    src.mkdir()
    _previous_hf_output(out)
    (out / "notes.txt").write_text("the user's")
    (out / "eval").mkdir()
    msg = _refused(out, True, HF_OUTPUT, src)  # --force: refused, nothing deleted
    assert msg.startswith(f"-o {out} holds 'eval' (and 1 more), which this tool does not write")
    assert (out / "notes.txt").read_text() == "the user's" and (out / "config.json").exists()
    assert "--force" not in msg.partition(";")[0]


def test_force_replaces_a_previous_output_only(tmp_path: Path) -> None:
    src, out = tmp_path / "hf_in", tmp_path / "mc"
    src.mkdir()
    out.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "metadata.json",
                 convert.META_FILE):  # fmt: skip
        (out / name).write_text("old")
    (out / convert.HF_CONFIG_DIR).mkdir()
    assert "pass --force to replace it" in _refused(out, False, MEGATRON_OUTPUT, src)
    convert._prepare_output(out, True, MEGATRON_OUTPUT, src)
    assert list(out.iterdir()) == []  # every entry was the tool's own: all replaced
    convert._check_output(tmp_path / "new", False, MEGATRON_OUTPUT, src)  # absent: fine


@pytest.mark.parametrize("out", ["SRC", "SRC/hf", "PARENT"])
def test_the_output_is_never_the_input(tmp_path: Path, out: str) -> None:
    src = tmp_path / "step_000060"
    src.mkdir()
    target = {"SRC": src, "SRC/hf": src / "hf", "PARENT": tmp_path}[out]
    assert "overwrite its own input" in _refused(target, True, HF_OUTPUT, src)
