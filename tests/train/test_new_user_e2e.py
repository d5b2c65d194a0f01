"""New-user faults end to end (issue 25; docs/reliability.md "New-user faults (issue 25)").

Three launches of the tiny toy under torchrun with the embedded engine:

* A (2 ranks, EP=2): a user reward that returns NaN / None / a string / a list for every
  sample. With train.max_failed_reward_steps=2 the job writes a checkpoint after step 2 and
  exits 3 with one message (before: 4 steps of loss 0, exit 0).
* B (2 ranks): resumes A with another learning rate and the toy reward, `checkpoint.dir` on a
  3 MB tmpfs that holds A's checkpoint but not a second one (when this test may mount; else a
  plain directory). Step 3 trains at the new learning rate (the log says so; before: a
  `KeyError` of megatron-core's param-group key on every rank), then its checkpoint cannot be
  written: exit 5, one line naming the directory and `No space left on device`, A's
  checkpoint intact (before: `CheckpointException` tracebacks from every rank).
* C (1 rank): the trainer on the 2-layer toy against an engine serving a 3-layer model
  (`rollout.launch=null`): refused before step 1 with exit 2, one line naming both models
  (before: every push "verified", the run trained on it).

Then the README's conversion command, exactly as written but for the paths, from a clean
environment (before: `ModuleNotFoundError: No module named 'megatron_gspo'`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from megatron_gspo.checkpoint.store import verify
from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.dist import free_port
from tools import make_tiny_toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
OUR_FRAMES = f'File "{ROOT}/megatron_gspo/'  # a traceback through our code


def _launch(tmp: Path, ranks: int, *sets: str, resume: bool = False) -> dict[str, Any]:
    base = {
        "model.hf_path": f"{tmp}/toy/model",
        "data.train_path": f"{tmp}/toy/toy.jsonl",
        "logging.dir": f"{tmp}/run",
        "checkpoint.dir": f"{tmp}/ckpt",
        "checkpoint.save_every": 0,
        "parallel.ep": ranks,
        "rl.prompts_per_rollout": 4,
        "rl.group_size": 4,
        "logging.tensorboard": "false",
        "logging.progress": "false",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    cmd += ["--master_port", str(free_port()), "-m", "megatron_gspo.train"]
    cmd += ["--config", str(ROOT / "examples/tiny_moe_cpu.yaml")]
    for key, value in base.items():
        cmd += ["--set", f"{key}={value}"]
    for s in sets:
        cmd += ["--set", s]
    cmd += ["--resume"] if resume else []
    # A file, not a pipe: torch's shared-memory manager (tensor weight transport) may outlive
    # the job while an engine holds the weights, and would keep a pipe open.
    log = tmp / f"launch_{uuid.uuid4().hex[:8]}.log"  # launches may run at once
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=out, timeout=600)
    out = log.read_text()
    # torchrun itself exits 1 when a worker fails; the ranks' own code is in its report
    codes = [int(c) for c in re.findall(r"failed \(exitcode: (\d+)\)", out)]
    return {"rc": codes[0] if codes else proc.returncode, "out": out}


def _engine(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """An embedded engine serving `model` in a process of its own; returns it and its URL."""
    import urllib.request

    port = free_port()
    cmd = [sys.executable, "-m", "megatron_gspo.engines.embedded.cli"]
    cmd += ["--model-path", str(model)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--port", str(port)], cwd=ROOT, env=ENV, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"the engine did not start: {log.read_text()[-3000:]}")


def _metrics(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _small_disk(path: Path, mb: int) -> bool:
    """A tmpfs of `mb` MB at `path` (root with mount rights only)."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        return False
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _other_model(tmp: Path, three: Path) -> tuple[dict[str, Any], str]:
    """Launch C: one rank against an engine serving the 3-layer model."""
    engine, url = _engine(three, tmp / "engine.log")
    try:
        c = _launch(
            tmp,
            1,
            "rollout.launch=null",
            f"rollout.client.engine_urls=[{url}]",
            f"logging.dir={tmp}/run_c",
            f"checkpoint.dir={tmp}/ckpt_c",
        )
    finally:
        engine.kill()
        engine.wait()
    return c, url


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("newuser")
    make_tiny_toy.main(["--out", str(tmp / "toy"), "--n", "64"])
    three = save_tiny_hf_checkpoint(tmp / "three_layers", perturb_norms=False, num_hidden_layers=3)
    # C (its own engine, its own directories) runs next to A then B: one launch leaves about
    # a third of the 2 cores idle (measured).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        lane_c = pool.submit(_other_model, tmp, three)
        a = _launch(
            tmp,
            2,
            "reward.kind=tests.train.bad_rewards:invalid",
            "train.steps=4",
            "train.max_failed_reward_steps=2",
        )
        disk = tmp / "disk"
        full = _small_disk(disk, 3)
        try:
            shutil.copytree(tmp / "ckpt", disk / "ckpt")
            b = _launch(
                tmp, 2, "optim.lr=1e-5", "train.steps=3", f"checkpoint.dir={disk}/ckpt", resume=True
            )
            b["kept_verified"] = verify(disk / "ckpt" / "step_000002") is None
            b["latest"] = (disk / "ckpt" / "latest").read_text().strip()
            b["left"] = sorted(p.name for p in (disk / "ckpt").iterdir() if p.name[0] != ".")
            b["full"] = full
        finally:
            if full:
                subprocess.run(["umount", str(disk)], capture_output=True)
        c, url = lane_c.result()
    return {"tmp": tmp, "a": a, "b": b, "c": c, "engine": url, "three": three}


def test_every_reward_failing_stops_with_a_checkpoint(runs) -> None:
    a, tmp = runs["a"], runs["tmp"]
    assert a["rc"] == 3, a["out"][-4000:]
    lines = [ln for ln in a["out"].splitlines() if ln.startswith("[train] stopped:")]
    assert len(lines) == 1 and "every reward call failed in 2 consecutive steps" in lines[0], a[
        "out"
    ][-4000:]
    assert f"checkpoint written at step 2 in {tmp}/ckpt" in lines[0]
    assert OUR_FRAMES not in a["out"]
    m = _metrics(tmp / "run")
    # the reference: every value the function returns is unusable, so every sample scores 0
    assert [m[s]["reward/failed_frac"] for s in (1, 2)] == [1.0, 1.0]
    assert [m[s]["reward/mean"] for s in (1, 2)] == [0.0, 0.0]
    assert (tmp / "ckpt" / "latest").read_text().strip() == "step_000002"


def test_resume_with_another_learning_rate_applies_it_from_the_resumed_step(runs) -> None:
    b, tmp = runs["b"], runs["tmp"]
    assert "KeyError" not in b["out"], b["out"][-4000:]
    said = [ln for ln in b["out"].splitlines() if ln.startswith("[train] resumed at step 2")]
    assert len(said) == 1 and "optim.lr: 0.003 -> 1e-05" in said[0], b["out"][-4000:]
    assert "applied from step 3 on" in said[0]
    m = _metrics(tmp / "run")
    assert m[2]["optim/lr"] == pytest.approx(3e-3, rel=1e-12)  # A's
    assert m[3]["optim/lr"] == pytest.approx(1e-5, rel=1e-12)  # the new value, at step 3


def test_a_checkpoint_that_cannot_be_written_is_one_line(runs) -> None:
    b = runs["b"]
    if not b["full"]:
        assert b["rc"] == 0, b["out"][-4000:]
        pytest.skip("no tmpfs to fill (needs root with mount rights)")
    assert b["rc"] == 5, b["out"][-4000:]
    errors = [ln for ln in b["out"].splitlines() if ln.startswith("error: CheckpointWriteError")]
    assert len(errors) == 1, b["out"][-4000:]
    disk = f"{runs['tmp']}/disk/ckpt"
    assert f"{disk}: cannot write the checkpoint of step 3" in errors[0], errors[0]
    assert "No space left on device" in errors[0] and "still names step_000002" in errors[0]
    assert OUR_FRAMES not in b["out"], b["out"][-4000:]
    assert "torch.distributed.checkpoint.api.CheckpointException" not in b["out"]  # traceback
    # the previous checkpoint is whole, still `latest`; the partial one was removed
    assert b["kept_verified"] and b["latest"] == "step_000002"
    assert b["left"] == ["latest", "step_000002"], b["left"]


def test_an_engine_serving_another_model_is_refused_before_step_1(runs) -> None:
    c, tmp = runs["c"], runs["tmp"]
    assert c["rc"] == 2, c["out"][-4000:]
    mismatch = "error: the rollout engines serve another model than the trainer: "
    errors = [ln for ln in c["out"].splitlines() if ln.startswith(mismatch)]
    assert len(errors) == 1, c["out"][-4000:]
    assert f"{runs['engine']} serves {runs['three']}" in errors[0], errors[0]
    assert f"model.hf_path={tmp}/toy/model" in errors[0]
    assert "model.layers.2." in errors[0] and "did not write" in errors[0], errors[0]
    assert OUR_FRAMES not in c["out"]
    assert not (tmp / "run_c" / "metrics.jsonl").read_text().strip()  # no step was trained


def test_the_readme_conversion_command_runs_as_written(runs) -> None:
    """The README's command (its paths replaced by this run's), by bash from the repository
    root in an environment without PYTHONPATH, as after `bash scripts/main.sh`."""
    tmp = runs["tmp"]
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    code = [i for i, ln in enumerate(lines) if ln.startswith("    ") and "tools/convert_meg" in ln]
    (start,) = code
    parts = [lines[start]]
    while parts[-1].endswith("\\"):  # a command continued on the next line
        parts[-1] = parts[-1][:-1]
        parts.append(lines[start + len(parts)])
    command = " ".join(p.strip() for p in parts)
    command = command.replace("runs/tiny_moe_cpu/ckpt/step_000060", f"{tmp}/ckpt/step_000002")
    command = command.replace("hf_trained", f"{tmp}/hf_trained")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    proc = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, command + "\n" + proc.stderr[-4000:]
    from safetensors import safe_open

    (shard,) = (tmp / "hf_trained").glob("*.safetensors")
    with safe_open(str(shard), "pt") as f:
        names = set(f.keys())
    with safe_open(str(tmp / "toy" / "model" / "model.safetensors"), "pt") as f:
        assert names == set(f.keys())  # the trained model has the toy's tensors
