"""Trainer faults end to end: signals, a rank raising or dying, SIGKILL at three points.

2 CPU ranks (EP=2) under torchrun with the embedded engine, 6 steps, a checkpoint every 2. One
reference run trains straight through (the session's, shared: tests/train/reference.py). A
second run is interrupted by each fault of `CHAIN` in turn, every launch resuming (`--resume`)
from whatever checkpoint the previous one left; the faults are planted by `MGSPO_FAULT`
(megatron_gspo/run/faults.py), at exact points rather than by timing. Checks, per launch: it ends
within `BOUND_S` (after a signal torchrun waits its --shutdown-timeout, set far above it, so a
rank that does not end by itself fails the test; after a rank FAILS, torchrun 2.13 SIGKILLs
the others 30 s later whatever that flag says), the `latest` checkpoint is the expected one, no
process of the job (rank, engine, reward worker) is left running. At the end: every step's
metrics and the final weights equal the reference run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from megatron_gspo.dist import free_port
from tests.train.reference import GRACE_S, ROOT, STEPS, TORCHRUN_SHUTDOWN_S, command

pytestmark = pytest.mark.multirank
BOUND_S = 150  # a whole launch, start-up included (~25 s); the planted hang would take 600 s
assert TORCHRUN_SHUTDOWN_S > BOUND_S

# (MGSPO_FAULT, the checkpoint `latest` names afterwards, lines the job prints, the exit code:
#  0, "non-zero", or None for torchrun's own on a signal)
CHAIN: list[tuple[str, int, tuple[str, ...], int | str | None]] = [
    # SIGTERM on rank 1 only: every rank stops after step 1, with a checkpoint (not a
    # save_every step), exit 0
    ("sigterm@rollout:1:1", 1, ("[train] SIGTERM: checkpoint written at step 1",), 0),
    # Ctrl-C on the launcher (torchrun forwards SIGINT): step 2 (save_every), step 3, stop
    ("ctrl-c@backward:3:0", 3, ("[train] SIGINT: checkpoint written at step 3",), None),
    # Ctrl-C twice: forced exit in the middle of step 4, no checkpoint
    # (torchrun answers the second with SIGTERM: "SIGTERM after SIGINT"; not the grace timer)
    ("ctrl-c-twice@rollout:4:0", 3, ("SIGINT: exiting now without a checkpoint",), "non-zero"),
    # SIGTERM on the launcher (preemption) while rank 1 is stuck (as in a collective with a
    # dead peer): torchrun forwards it and would wait TORCHRUN_SHUTDOWN_S; each rank exits
    # train.stop_grace_s after the signal by itself (exit 130)
    (
        "sigterm-launcher@rollout:4:0,hang@backward:4:1",
        3,
        (f"still running {GRACE_S} s after SIGTERM (train.stop_grace_s)",),
        "non-zero",
    ),
    # an exception on rank 1: torchrun ends rank 0 (dist_timeout_s is 1 h)
    ("raise@backward:4:1", 3, ("PlantedFault: planted fault at backward of step 4",), "non-zero"),
    ("sigkill@rollout:4:0", 3, (), "non-zero"),  # rank 0 mid-rollout (rank 1 waits for it)
    ("sigkill@backward:4:1", 3, (), "non-zero"),  # rank 1 mid-backward
    ("sigkill@checkpoint:4:0", 3, (), "non-zero"),  # rank 0 writing the step-4 checkpoint
    # issue 26: a closed terminal (torchrun forwards its SIGHUP; was: SIGHUP's default action
    # ended every rank without a checkpoint) ...
    ("sighup-launcher@rollout:4:0", 4, ("[train] SIGHUP: checkpoint written at step 4",), None),
    # ... and the launcher SIGKILLed: the ranks' PR_SET_PDEATHSIG (stop.LAUNCHER_DIED, possibly
    # once per torchrun thread) is a graceful stop (was SIGINT, taken for a user's Ctrl-C twice)
    (
        "sigkill-launcher@backward:5:0",
        5,
        ("[train] the launcher died: checkpoint written at step 5",),
        None,
    ),
    ("", STEPS, (), 0),  # the rest of the run
]


def _job_processes(marker: str) -> list[psutil.Process]:
    """Every live process started by the launch tagged `marker` (environment or arguments)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("MGSPO_TEST_JOB") == marker or marker in " ".join(p.cmdline()):
                found.append(p)
    return found


def _launch(tmp: Path, run: str, fault: str, resume: bool) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    env |= {"MGSPO_FAULT": fault, "MGSPO_TEST_JOB": marker}
    cmd = command(tmp, run) + (["--resume"] if resume else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # what a terminal does for a foreground job
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=BOUND_S)
        timed_out = False
    except subprocess.TimeoutExpired:
        for p in _job_processes(marker):
            with contextlib.suppress(psutil.Error):
                p.kill()
        out, _ = proc.communicate()
        timed_out = True
    left = _job_processes(marker)
    deadline = time.monotonic() + 10  # SIGKILLed children: reaped by the kernel, not by us
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _job_processes(marker)
    latest = tmp / run / "ckpt" / "latest"
    return {
        "fault": fault,
        "rc": proc.returncode,
        "seconds": time.monotonic() - t0,
        "timed_out": timed_out,
        "output": out,
        "left": [" ".join(p.cmdline()[:6]) for p in left],
        "latest": latest.read_text().strip() if latest.exists() else None,
    }


def _metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(reference_started: tuple[Path, Any]) -> dict[str, Any]:
    """The chain in run "b", next to the shared reference run "ref" (tests/train/reference.py,
    also run A of test_train_e2e.py) and its toy; the reference trains meanwhile."""
    tmp, reference = reference_started
    t0 = time.monotonic()
    chain = [_launch(tmp, "b", fault, resume=i > 0) for i, (fault, *_) in enumerate(CHAIN)]
    seconds = time.monotonic() - t0
    return {"tmp": tmp, "ref": reference.result(), "chain": chain, "seconds": seconds}


@pytest.mark.parametrize("i", range(len(CHAIN)), ids=[c[0] or "finish" for c in CHAIN])
def test_each_fault_ends_the_job_in_time_leaving_nothing(runs, i: int) -> None:
    fault, latest, lines, rc = CHAIN[i]
    got = runs["chain"][i]
    tail = got["output"][-4000:]
    assert not got["timed_out"], f"{fault}: still running after {BOUND_S} s\n{tail}"
    assert got["left"] == [], f"{fault}: processes left running: {got['left']}"
    assert got["latest"] == f"step_{latest:06d}", f"{fault}\n{tail}"
    for line in lines:
        assert line in got["output"], f"{fault}: {line!r} not printed\n{tail}"
    if rc == 0:
        assert got["rc"] == 0, f"{fault}\n{tail}"
    elif rc == "non-zero":
        assert got["rc"] != 0, f"{fault}\n{tail}"


def test_interrupted_run_reproduces_the_reference(runs) -> None:
    """Every step's metrics (written by the launch that finished the step last) and the final
    weights equal the uninterrupted run's: each fault cost at most a retry."""
    from safetensors.torch import load_file

    tmp = runs["tmp"]
    ref, got = _metrics(tmp / "ref"), _metrics(tmp / "b")
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        for k in ("loss", "reward/mean", "grad_norm", "policy/clip_frac"):
            assert got[step][k] == pytest.approx(ref[step][k], rel=1e-5, abs=1e-7), (step, k)

    def weights(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    a, b = weights(tmp / "ref/ckpt/hf_final"), weights(tmp / "b/ckpt/hf_final")
    assert a.keys() == b.keys() and a
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= 1e-6, k
    each = " ".join(f"{r['seconds']:.0f}" for r in runs["chain"])
    ref_s = runs["ref"]["seconds"]
    print(f"\n[faults e2e] {len(CHAIN)} launches in {runs['seconds']:.0f} s ({each})", end="")
    print(f"; the reference run {ref_s:.0f} s")


def _ranks(tmp: Path, run: str, world: int, *extra: str) -> list[subprocess.CompletedProcess]:
    """The trainer's entry point as `world` ranks started by hand (what torchrun sets up), so
    that each rank's exit code and output are seen without torchrun's own report."""
    cmd = command(tmp, run)
    cmd = [sys.executable, *cmd[cmd.index("-m", 3) :], "--resume", *extra]
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        env |= {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=BOUND_S)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_resume_at_another_layout_is_refused_naming_both(runs) -> None:
    """One rank with parallel.ep=1 against the 2-rank EP=2 checkpoint: refused by preflight,
    one line, exit 2, nothing started."""
    (proc,) = _ranks(runs["tmp"], "b", 1, "--set", "parallel.ep=1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    common = "tp=1 pp=1 vpp=None cp=1"
    assert f"written at layout {common} ep=2 etp=1 sp=False dp=2 on 2 ranks" in lines[0]
    assert f"this run has {common} ep=1 etp=1 sp=False dp=1 on 1 ranks" in lines[0]


def test_corrupted_checkpoint_is_refused_naming_the_file(runs) -> None:
    """A flipped byte in a shard of the latest checkpoint: every rank refuses to resume (exit
    2), rank 0 names the file and the earlier checkpoint in one line."""
    ckpt = runs["tmp"] / "b/ckpt"
    shard = ckpt / "step_000006/__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    procs = _ranks(runs["tmp"], "b", 2)
    assert [p.returncode for p in procs] == [2, 2], procs[0].stderr[-3000:]
    assert procs[1].stderr.strip() == ""  # rank 0 speaks for the job
    (line,) = procs[0].stderr.strip().splitlines()
    assert line.startswith(f"error: {shard}: its sha256 differs")
    earlier = runs["chain"][-2]["latest"]  # what `latest` named before the last launch
    assert f"write {earlier} into {ckpt / 'latest'}" in line
