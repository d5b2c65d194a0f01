"""Issue 26 (1, 6, 8): who may write a run's directories (megatron_gspo/run/run_dir.py), through the
same `preflight` every rank runs before anything starts. One process; the lock's holder is a
second process that is then SIGKILLed (the stale lock it leaves must not block a new run)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.config_io import ConfigError
from megatron_gspo.run.preflight import preflight
from megatron_gspo.run.run_dir import LOCK_NAME, RunLock, clear_previous_run
from tests.test_bad_input import _base, _write

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp: Path, **sections: dict):
    data = _base(tmp)
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return load_config(_write(tmp, data))


def _refusal(cfg, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        preflight(cfg, resume=False, overwrite=kw.get("overwrite", False), world_size=1)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


HOLDER = textwrap.dedent("""
    import sys, time
    from megatron_gspo.config import load_config
    from megatron_gspo.run.run_dir import RunLock
    RunLock.acquire(load_config(sys.argv[1]))
    print("locked", flush=True)
    time.sleep(120)
""")


def test_a_run_directory_in_use_is_refused_naming_pid_and_host(tmp_path: Path) -> None:
    """A second run into the directory of a running one is refused, naming the first's PID
    and host (was: both ran, metrics interleaved and checkpoints mixed); once the first is
    SIGKILLed, its lock file is stale and the next run takes it."""
    cfg = _cfg(tmp_path)
    preflight(cfg, resume=False, overwrite=False, world_size=1)  # free: passes
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "run.yaml")],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        msg = _refusal(cfg)
        assert msg.startswith(f"{tmp_path / 'run'}: in use by the run of PID {holder.pid} on "
                              f"host {socket.gethostname()}"), msg  # fmt: skip
        # --overwrite does not get past it either (scripts/main.sh always passes it)
        assert "in use by the run of PID" in _refusal(cfg, overwrite=True)
        with pytest.raises(ConfigError, match=f"PID {holder.pid}"):
            RunLock.acquire(cfg)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert str(holder.pid) in (tmp_path / "run" / LOCK_NAME).read_text()  # stale, left behind
    preflight(cfg, resume=False, overwrite=False, world_size=1)
    lock = RunLock.acquire(cfg)
    assert f'"pid": {os.getpid()}' in (tmp_path / "ckpt" / LOCK_NAME).read_text()
    lock.release()


@pytest.mark.parametrize(
    "where, expected",
    [
        ({"logging": {"dir": "MODEL"}}, "logging.dir=MODEL is inside model.hf_path=MODEL"),
        ({"checkpoint": {"dir": "MODEL/ckpt"}}, "checkpoint.dir=MODEL/ckpt is inside model."),
        (
            {"model": {"tokenizer_path": "TOK"}, "logging": {"dir": "TOK/run"}},
            "logging.dir=TOK/run is inside model.tokenizer_path=TOK",
        ),
        ({"logging": {"dir": "TMP"}}, "logging.dir=TMP is the directory of data.train_path"),
        (
            {"model": {"hf_path": "TMP/ckpt/hf_final"}},
            "model.hf_path=TMP/ckpt/hf_final lies in TMP/ckpt/hf_final, which the run writes",
        ),
        (
            {"data": {"train_path": "TMP/ckpt/step_000002/train.jsonl"}},
            "data.train_path=TMP/ckpt/step_000002/train.jsonl lies in TMP/ckpt/step_000002, "
            "which the run writes (checkpoint.dir)",
        ),
    ],
    ids=["log-in-model", "ckpt-in-model", "log-in-tokenizer", "log-is-data-dir", "model-is-export",
         "data-in-a-step-dir"],
)  # fmt: skip
def test_never_write_into_a_model_or_data_directory(tmp_path: Path, where, expected) -> None:
    """Refused before start (was: logging.dir=<model> replaced the model's config.json with the
    run config; the next run failed with "the model has no experts")."""
    (tmp_path / "tok").mkdir()
    subst = {"MODEL": str(tmp_path / "model"), "TOK": str(tmp_path / "tok"), "TMP": str(tmp_path)}

    def fill(text: str) -> str:
        for k, v in subst.items():
            text = text.replace(k, v)
        return text

    sections = {s: {k: fill(v) for k, v in kv.items()} for s, kv in where.items()}
    cfg = _cfg(tmp_path, **sections)
    if "hf_final" in str(cfg.model.hf_path):  # a model exported there by a previous run
        model = Path(cfg.model.hf_path)
        model.mkdir(parents=True)
        for f in (tmp_path / "model").iterdir():
            (model / f.name).write_bytes(f.read_bytes())
    if "step_000002" in cfg.data.train_path:  # --overwrite and checkpoint.keep_last delete it
        Path(cfg.data.train_path).parent.mkdir(parents=True)
        Path(cfg.data.train_path).write_text((tmp_path / "data.jsonl").read_text())
    before = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert _refusal(cfg).startswith(fill(expected))
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == before


def test_a_failed_start_does_not_block_the_retry(tmp_path: Path) -> None:
    """An empty metrics.jsonl (a start that failed before step 1) is not a previous run (was:
    the retry was refused); one with a logged step still is."""
    cfg = _cfg(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    preflight(cfg, resume=False, overwrite=False, world_size=1)
    (tmp_path / "run" / "metrics.jsonl").write_text("\n")  # a blank line: still nothing logged
    preflight(cfg, resume=False, overwrite=False, world_size=1)
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    assert "a previous run is there" in _refusal(cfg)


def test_overwrite_deletes_nothing_before_the_run_has_started(tmp_path: Path, monkeypatch) -> None:
    """--overwrite: preflight (every rank, before anything starts) deletes nothing (was: rank 0
    deleted the previous run's checkpoints there, so a Ctrl-C or a failed engine start in the
    first seconds lost them); `clear_previous_run`, which `train.main` calls once the engines
    are up, removes the run's own files only."""
    monkeypatch.delenv("RANK", raising=False)
    cfg = _cfg(tmp_path)
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    (run / "tb").mkdir(parents=True)
    for name in ("metrics.jsonl", "train.log", "config.json"):
        (run / name).write_text('{"step": 1}\n')
    (ckpt / "step_000002").mkdir(parents=True)
    (ckpt / "latest").write_text("step_000002")
    (ckpt / "notes.txt").write_text("the user's")
    snapshot = sorted(str(p) for p in tmp_path.rglob("*"))
    preflight(cfg, resume=False, overwrite=True, world_size=1)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == snapshot
    clear_previous_run(cfg)
    assert sorted(p.name for p in run.iterdir()) == []
    assert sorted(p.name for p in ckpt.iterdir()) == ["notes.txt"]
