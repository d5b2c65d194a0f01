"""Checkpoint checksums and the resume layout check (megatron_gspo/checkpoint/store.py), on
hand-made checkpoint directories (one process). The trainer's own checkpoints go through the
same functions in tests/train/test_faults_e2e.py (each resume there verifies one, and a
flipped byte in a real one is refused by the entry point)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from megatron_gspo.checkpoint.files import META_FILE
from megatron_gspo.checkpoint.store import (
    MANIFEST,
    check_resume_layout,
    latest_checkpoint,
    required_files,
    verify,
    write_manifest,
)
from megatron_gspo.config_io import ConfigError
from megatron_gspo.layout import Layout


def _checkpoint(root: Path, step: int, layout: Layout | None = None, world: int = 2) -> Path:
    d = root / f"step_{step:06d}"
    (d / "hf_config").mkdir(parents=True)
    for name in required_files(world):  # what a `world`-rank job writes
        (d / name).write_bytes(name.encode())
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (d / ".metadata").write_bytes(b"torch dist metadata")
    (d / "trainer_rank0.pt").write_bytes(b"x" * 1000)
    (d / "hf_config" / "config.json").write_text("{}")
    meta = {"layout": (layout or Layout(ep=2)).to_dict(), "world_size": world}
    (d / META_FILE).write_text(json.dumps(meta))
    write_manifest(d)
    (root / "latest").write_text(d.name)
    return d


def _refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as e:
        verify(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_manifest_lists_every_file_and_an_intact_checkpoint_passes(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path, 2)
    files = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(files) == required_files(2)
    assert "__1_0.distcp" in files and "trainer_rank1.pt" in files
    verify(d)  # no error


def test_a_checkpoint_without_a_required_file_is_never_valid(tmp_path: Path) -> None:
    """Issue 26 (1): the manifest must cover the files a checkpoint must have, not the files
    that happen to be there (two runs writing one step directory left one without its shards
    that passed). The reference: the same directory with the file passes."""
    d = _checkpoint(tmp_path, 2)
    (d / "__1_0.distcp").unlink()
    # a manifest of the files present (what the writer sealed before)
    present = {
        p.relative_to(d).as_posix(): {
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "bytes": p.stat().st_size,
        }
        for p in d.rglob("*")
        if p.is_file() and p.name != MANIFEST
    }
    (d / MANIFEST).write_text(json.dumps({"algorithm": "sha256", "files": present}))
    msg = _refusal(d)
    assert msg.startswith(f"{d / '__1_0.distcp'}: not in the checkpoint's manifest"), msg
    # the writer refuses to seal such a directory at all (world size 1 here: rank 0's shard)
    (d / "__0_0.distcp").unlink()
    with pytest.raises(RuntimeError, match=r"lacks __0_0\.distcp"):
        write_manifest(d)


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    d = _checkpoint(tmp_path, 4)
    shard = d / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x01
    shard.write_bytes(bytes(data))
    msg = _refusal(d)
    assert msg.startswith(f"{shard}: its sha256 differs")
    # the way back is named: the earlier checkpoint
    assert f"write step_000002 into {tmp_path / 'latest'}" in msg


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: (d / "trainer_rank0.pt").write_bytes(b"x" * 10), "trainer_rank0.pt: 10 bytes"),
        (lambda d: (d / "hf_config" / "config.json").unlink(), "config.json: missing"),
        (lambda d: (d / MANIFEST).unlink(), f"{MANIFEST}: missing"),
        (lambda d: (d / MANIFEST).write_text("{"), f"{MANIFEST}: unreadable"),
    ],
    ids=["truncated", "deleted", "no-manifest", "bad-manifest"],
)
def test_truncated_missing_or_unlisted_files_are_refused(tmp_path: Path, damage, expected) -> None:
    d = _checkpoint(tmp_path, 2)
    damage(d)
    msg = _refusal(d)
    assert expected in msg and "There is no earlier checkpoint" in msg


def test_latest_naming_nothing_is_refused(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step_000009")
    with pytest.raises(ConfigError, match="names 'step_000009', which is not a checkpoint"):
        latest_checkpoint(tmp_path)
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_resume_at_another_layout_is_refused_naming_both(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2, Layout(ep=2), world=2)
    check_resume_layout(str(tmp_path), Layout(ep=2), 2)  # same layout: accepted
    check_resume_layout(str(tmp_path), Layout(ep=2, dp=2), 2)  # dp spelled out: the same
    with pytest.raises(ConfigError) as e:
        check_resume_layout(str(tmp_path), Layout(ep=1), 2)
    msg = str(e.value)
    assert "written at layout tp=1 pp=1 vpp=None cp=1 ep=2 etp=1 sp=False dp=2 on 2 ranks" in msg
    assert "this run has tp=1 pp=1 vpp=None cp=1 ep=1 etp=1 sp=False dp=2 on 2 ranks" in msg
    with pytest.raises(ConfigError, match="dp=4 on 4 ranks"):  # another DP size: refused too
        check_resume_layout(str(tmp_path), Layout(ep=2), 4)
    check_resume_layout(None, Layout(ep=1), 2)  # no checkpoint.dir: nothing to check
    (tmp_path / "step_000002" / META_FILE).write_text("not json")
    with pytest.raises(ConfigError, match=f"{META_FILE}: cannot read the checkpoint's layout"):
        check_resume_layout(str(tmp_path), Layout(ep=2), 2)
