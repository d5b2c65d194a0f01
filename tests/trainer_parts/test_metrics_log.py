"""Metrics sink (JSONL, TensorBoard, rank gating, console line) and the plotting tool."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import load_config
from megatron_gspo.metrics_log import MetricsLogger, to_scalars

ROOT = Path(__file__).resolve().parents[2]


def load_plot_tool():
    spec = importlib.util.spec_from_file_location("plot_metrics", ROOT / "tools/plot_metrics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_to_scalars():
    got = to_scalars(
        {"a": 1, "b": torch.tensor(2.5), "c": True, "d": "text", "e": torch.ones(3), "f": 0.1}
    )
    assert got == {"a": 1.0, "b": 2.5, "c": 1.0, "f": 0.1}


def test_jsonl_lines_are_flushed_per_step(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=False, progress=False, rank=0, config={"x": 1})
    m.log(0, {"reward/mean": torch.tensor(0.25), "policy/clip_frac": 0.01})
    # Readable before close: a crashed run still leaves its curve behind.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["step"] == 0 and row["reward/mean"] == 0.25 and row["policy/clip_frac"] == 0.01
    m.log(1, {"reward/mean": float("nan")})
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and math.isnan(rows[1]["reward/mean"])
    assert json.loads((tmp_path / "config.json").read_text()) == {"x": 1}
    # A resumed run appends.
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, rank=0) as m2:
        m2.log(2, {"reward/mean": 0.5})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, jsonl=False, progress=False, rank=0) as m:
        for step in range(3):
            m.log(step, {"reward/mean": 0.1 * step, "loss": torch.tensor(1.0 - step)})
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward/mean", "loss"}
    assert [e.step for e in acc.Scalars("loss")] == [0, 1, 2]
    assert [round(e.value, 6) for e in acc.Scalars("reward/mean")] == [0.0, 0.1, 0.2]


def test_other_ranks_write_nothing(tmp_path):
    m = MetricsLogger(tmp_path / "r1", rank=1, progress=True)
    m.log(0, {"reward/mean": 1.0})
    m.close()
    assert not (tmp_path / "r1").exists()


def test_rank_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    MetricsLogger(tmp_path / "r3", tensorboard=False).log(0, {"a": 1})
    assert not (tmp_path / "r3").exists()


def test_wandb_missing_is_skipped(tmp_path):
    pytest.importorskip("tensorboard")
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    with pytest.warns(UserWarning, match="wandb is not installed"):
        m = MetricsLogger(tmp_path, tensorboard=False, wandb_project="proj", progress=False, rank=0)
    m.log(0, {"a": 1.0})
    m.close()
    assert (tmp_path / "metrics.jsonl").exists()


def test_log_every_and_console_line(tmp_path, capsys):
    cfg = load_config(
        None,
        [
            "model.hf_path=/m",
            "data.train_path=/d",
            f"logging.dir={tmp_path}",
            "logging.log_every=2",
            "logging.tensorboard=false",
        ],
    )
    with MetricsLogger.from_config(cfg.logging, total_steps=4, rank=0) as m:
        for step in range(4):
            m.log(step, {"reward/mean": 0.5, "policy/clip_frac": 2e-4, "other": 1.0})
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 2]
    err = capsys.readouterr().err  # not a terminal here: one plain line per step
    assert "step 3/4 | reward/mean 0.5 | policy/clip_frac 2.000e-04" in err
    assert "other" not in err


def test_plot_tool_writes_png(tmp_path):
    plot = load_plot_tool()
    path = tmp_path / "metrics.jsonl"
    with open(path, "w") as f:
        for step in range(30):
            row = {
                "step": step,
                "reward/mean": 0.1 + 0.02 * step,
                "policy/clip_frac": 0.01,
                "policy/clip_frac_low": 0.004,
                "policy/clip_frac_high": 0.006,
                "loss": float("nan") if step == 5 else 1.0 / (step + 1),
            }
            f.write(json.dumps(row) + "\n")
        f.write(json.dumps({"step": 29, "reward/mean": 0.9}) + "\n")  # resumed: last one wins
        f.write('{"step": 30, "rew')  # a run killed mid-write
    rows = plot.read_metrics(path)
    assert len(rows) == 30 and rows[29]["reward/mean"] == 0.9
    out = tmp_path / "png" / "curves.png"
    assert plot.main([str(path), "--out", str(out), "--smooth", "5"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    out2 = tmp_path / "loss.png"
    assert plot.main([str(path), "--keys", "loss,reward/mean", "--out", str(out2)]) == 0
    assert out2.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        plot.main([str(path), "--keys", "nope", "--out", str(tmp_path / "x.png")])
    assert not (tmp_path / "x.png").exists()
