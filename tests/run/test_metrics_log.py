"""Metrics sink (JSONL, TensorBoard, rank gating, progress bar, train.log), the third-party
output routing, and the tools that read metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import load_config
from megatron_gspo.run import console
from megatron_gspo.run.metrics_log import MetricsLogger, read_metrics, to_scalars

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name: str = "plot_metrics"):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"tools/{name}.py")
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
    m.log(1, {"reward/mean": 0.5})
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["reward/mean"] == 0.5
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
    text = (tmp_path / "train.log").read_text().splitlines()  # every step, not every log_every
    assert len(text) == 4 and text[3].endswith(
        "step 3/4 | reward/mean 0.5 | policy/clip_frac 2.000e-04"
    )
    assert "other" not in text[3]
    assert "step 3/4" not in capsys.readouterr().err  # the console has the bar, not the lines


def test_non_finite_values_are_kept(tmp_path, capsys):
    """A NaN / inf metric is written (as a JSON string), shown in train.log and above the bar,
    read back by read_metrics and the tools, and accepted by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, rank=0, total_steps=3) as m:
        m.log(1, {"reward/mean": 0.1, "loss": 1.0})
        m.log(2, {"reward/mean": 0.2, "loss": float("nan"), "grad_norm": torch.tensor(math.inf)})
        m.log(3, {"reward/mean": 0.3, "policy/ratio_max": float("-inf")})
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in raw]  # strict JSON: no bare NaN / Infinity tokens
    assert "NaN" not in raw[1] and "Infinity" not in raw[1]
    assert rows[1]["loss"] == "nan" and rows[1]["grad_norm"] == "inf"
    assert rows[2]["policy/ratio_max"] == "-inf"
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back[2]["loss"]) and back[2]["grad_norm"] == math.inf
    assert back[3]["policy/ratio_max"] == -math.inf and back[1]["loss"] == 1.0
    text = (tmp_path / "train.log").read_text().splitlines()
    assert "loss nan" in text[1] and "grad_norm inf" in text[1]
    assert "policy/ratio_max -inf" in text[2]  # not a console key, shown because non-finite
    err = capsys.readouterr().err
    assert "loss nan" in err and "policy/ratio_max -inf" in err
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2]
    assert (
        math.isnan(acc.Scalars("loss")[1].value) and acc.Scalars("grad_norm")[0].value == math.inf
    )
    # The tools read the file: the plot gets a gap, the summary counts and fails.
    plot = load_tool()
    assert (
        plot.main(
            [str(tmp_path / "metrics.jsonl"), "--keys", "loss", "--out", str(tmp_path / "l.png")]
        )
        == 0
    )
    summary = load_tool("reward_summary")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "reward/mean": "nan"}) + "\n")
    assert summary.nonfinite(str(tmp_path / "metrics.jsonl")) == 1
    assert summary.main([str(tmp_path / "metrics.jsonl"), "--window", "2", "--margin", "0"]) == 1
    assert "1 non-finite" in capsys.readouterr().out


def test_progress_bar_shows_eta_and_metrics(tmp_path, capsys, monkeypatch):
    import tqdm as tqdm_mod

    clock = iter(float(t) for t in range(0, 1000, 10))  # each step "takes" 10 s
    monkeypatch.setattr(tqdm_mod.std, "time", lambda: next(clock))
    with MetricsLogger(tmp_path, tensorboard=False, rank=0, total_steps=10, start_step=2) as m:
        for step in (3, 4, 5):
            m.log(step, {"reward/mean": 0.25, "loss": 0.5, "grad_norm": 1.5, "other": 3.0})
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r" 5/10 \[[0-9:]+<[0-9:]+,", last), last  # elapsed<ETA, not "<?"
    assert "reward=0.25" in last and "loss=0.5" in last and "grad_norm=1.5" in last
    assert "other" not in last


def test_progress_off_leaves_the_console_quiet(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, rank=0, progress=False, total_steps=2) as m:
        m.log(1, {"reward/mean": 0.25})
    assert capsys.readouterr().err == ""
    assert "step 1/2 | reward/mean 0.25" in (tmp_path / "train.log").read_text()


def test_third_party_output_goes_to_the_file(tmp_path, capfd):
    """Library logging (including loggers with their own console handler, made before and after
    the routing) and warnings land in third_party.log; our own warnings stay on the console."""
    before = logging.getLogger("thirdparty.early")
    before.addHandler(logging.StreamHandler())  # as megatron-bridge's import_utils does
    before.propagate = False  # as torch's loggers are
    try:
        path = console.route_third_party_output(tmp_path)
        assert path == tmp_path / "third_party.log"
        before.warning("EARLY-TRACEBACK")
        after = logging.getLogger("thirdparty.late")
        after.addHandler(logging.StreamHandler(sys.stderr))  # as transformers does on import
        after.propagate = False
        after.warning("LATE-DEPRECATION")
        logging.getLogger("thirdparty.plain").info("PLAIN-INFO")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("A-USERWARNING", UserWarning, stacklevel=1)
        logging.getLogger("megatron_gspo.rollout").warning("OUR-WARNING")
        with console.third_party_stdio(tmp_path):
            print(" > number of parameters: 42")
    finally:
        console._restore()
        before.handlers.clear()
    out, err = capfd.readouterr()
    for noise in ("EARLY-TRACEBACK", "LATE-DEPRECATION", "PLAIN-INFO", "A-USERWARNING", "42"):
        assert noise not in out + err, noise
    assert "OUR-WARNING" in err
    log = path.read_text()
    for noise in ("EARLY-TRACEBACK", "LATE-DEPRECATION", "PLAIN-INFO", "A-USERWARNING", "42"):
        assert noise in log, noise
    assert "rank0 WARNING thirdparty.early: EARLY-TRACEBACK" in log


def test_megatron_import_noise_is_routed(tmp_path):
    """The real thing, in a fresh process: importing megatron-bridge's pieces that log tracebacks
    (failed optional FP8 import) and build warnings prints nothing once routed."""
    code = (
        "import sys; from megatron_gspo.run.console import route_third_party_output as r; "
        f"r({str(tmp_path)!r}); "
        "from megatron_gspo.patches import apply_bridge_imports, apply_cpu_runtime; "
        "apply_cpu_runtime(); apply_bridge_imports(); "
        "import megatron.bridge.peft.utils; "
        "print('IMPORTED')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "IMPORTED" and proc.stderr == "", proc.stderr[-3000:]
    assert "FP8GlobalStateManager" in (tmp_path / "third_party.log").read_text()


def test_plot_tool_writes_png(tmp_path):
    plot = load_tool()
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


def test_a_stream_kept_from_inside_third_party_stdio_still_writes_to_the_log(tmp_path, capfd):
    """A logging handler made inside the block (its stream: the block's sys.stderr) and used
    after it (issue 40: `--- Logging error --- ... I/O operation on closed file` in
    third_party.log): its records land in third_party.log, and no logging error is printed."""
    import logging
    import sys

    from megatron_gspo.run.console import third_party_stdio

    logger = logging.getLogger("some_library_issue40")
    logger.propagate = False
    with third_party_stdio(tmp_path):
        handler = logging.StreamHandler(sys.stderr)
    logger.handlers.append(handler)  # not through addHandler: nothing redirects it
    try:
        with third_party_stdio(tmp_path):  # a later block, as the trainer has several
            logger.warning("inside a later block")
        logger.warning("after every block")
    finally:
        logger.handlers.remove(handler)
    text = (tmp_path / "third_party.log").read_text()
    err = capfd.readouterr().err
    assert "Logging error" not in text + err, text + err
    assert "inside a later block" in text and "after every block" in text, text


def test_held_library_output_goes_to_the_log_once_it_exists_or_back_to_the_caller(
    tmp_path, capfd
):
    """The conversion tools' routing (issue 40): library records, warnings and prints inside
    `routed_stdio` are held in memory, never on the console; `route_third_party_output` writes
    them to the file first (then later records), `release_held_output` hands them back."""
    import logging
    import warnings

    lib = logging.getLogger("some_library_held40")
    try:
        console.hold_third_party_output()
        lib.warning("REFUSED-RUN-NOISE")
        assert "REFUSED-RUN-NOISE" in console.release_held_output()
        assert console.release_held_output() == ""  # emptied
        lib.addHandler(logging.StreamHandler(sys.stderr))  # as transformers does on import
        lib.propagate = False
        lib.warning("BEFORE-THE-FILE")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("HELD-USERWARNING", UserWarning, stacklevel=1)
        with console.routed_stdio():
            print(" > number of parameters: 43")
        path = console.route_third_party_output(tmp_path)
        lib.warning("AFTER-THE-FILE")  # its handler was pointed at the buffer: now the file
    finally:
        console._restore()
        lib.handlers.clear()
        lib.propagate = True
    out, err = capfd.readouterr()
    text = path.read_text()
    for noise in ("REFUSED-RUN-NOISE", "BEFORE-THE-FILE", "HELD-USERWARNING", "43", "AFTER-THE"):
        assert noise not in out + err, noise
    for kept in ("BEFORE-THE-FILE", "HELD-USERWARNING", "number of parameters: 43", "AFTER-THE"):
        assert kept in text, (kept, text)
    assert "REFUSED-RUN-NOISE" not in text and text.index("BEFORE") < text.index("AFTER")
