"""W&B runs that resume as the same run (`metrics_log.MetricsLogger`, W&B in offline mode): a
logger started at a resumed step logs to the run id stored in the run directory with
resume="allow", against the trainer's step (so the steps it logs again are kept); a fresh run
gets a new id; `logging.wandb_run_id` names one. What was logged is read back from W&B's own
offline run files (its record log of protobuf `Record`s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.run.metrics_log import MetricsLogger

wandb = pytest.importorskip("wandb")
pytestmark = pytest.mark.slow  # W&B's service process: ~10-15 s on 2 shared cores


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))


def _records(path: Path):
    """The protobuf records of a .wandb file: a ':W&B' header, then LevelDB-log-style
    32 KiB blocks of (crc32, length, type) chunks; type 1 is a whole record, 2-4 its parts."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # the writer is mid-chunk
            return
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record
            buf = b""


def _offline_runs(log_dir: Path) -> list[tuple[str, list[tuple[float, float]]]]:
    """(run id, [(trainer/step, reward/mean), ...]) of each offline run, oldest first. W&B's
    service process may still be writing a file after `finish()` returned: a run is read once
    its file holds the closing "exit" record."""
    out = []
    for f in sorted(log_dir.glob("wandb/offline-run-*/run-*.wandb")):
        deadline = time.monotonic() + 30
        while True:
            records = list(_records(f))
            kinds = [r.WhichOneof("record_type") for r in records]
            if "exit" in kinds or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        run_id, points = None, []
        for r, kind in zip(records, kinds):
            if kind == "run":
                run_id = r.run.run_id
            elif kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): float(i.value_json) for i in r.history.item
                }
                points.append((items["trainer/step"], items["reward/mean"]))
        out.append((run_id, points))
    return out


def _log(log_dir: Path, start: int, steps: range, **kw) -> str:
    m = MetricsLogger(
        log_dir,
        wandb_project="mgspo-test",
        tensorboard=False,
        progress=False,
        rank=0,
        start_step=start,
        **kw,
    )
    assert m._wandb.settings.resume == "allow"
    run_id = m._wandb.id
    for s in steps:
        m.log(s, {"reward/mean": s / 10})
    m.close()
    return run_id


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path):
    run = tmp_path / "run"
    first = _log(run, 0, range(1, 4))  # steps 1-3; say the checkpoint was at step 2
    assert (run / "wandb_run_id").read_text().strip() == first
    resumed = _log(run, 2, range(3, 5))  # --resume: steps 3-4 again
    assert resumed == first
    runs = _offline_runs(run)
    assert [r[0] for r in runs] == [first, first]  # `wandb sync` merges them into one run
    # logged against the trainer's step: step 3 logged again is kept, not dropped by W&B
    assert runs[0][1] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert runs[1][1] == [(3, 0.3), (4, 0.4)]
    fresh = _log(run, 0, range(1, 2))  # a new run (--overwrite) in the same directory
    assert fresh != first and (run / "wandb_run_id").read_text().strip() == fresh


def test_logging_wandb_run_id_names_the_run(tmp_path):
    cfg = load_config(
        None, ["model.hf_path=m", "data.train_path=d", "logging.wandb_run_id=abc123def"]
    )
    assert cfg.logging.wandb_run_id == "abc123def"
    assert _log(tmp_path / "run", 0, range(1, 2), wandb_run_id="abc123def") == "abc123def"
