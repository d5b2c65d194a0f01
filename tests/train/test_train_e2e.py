"""The GSPO trainer end to end on 2 CPU ranks (EP=2) with the embedded engine.

Run A trains 6 steps straight (the session's shared reference run, tests/train/reference.py,
also the fault chain's), with a checkpoint every 2 steps. Run C resumes a copy of A's step-2
checkpoint to step 4. Run D trains 2 steps colocated (engine memory released during updates)
on the same prompts from a Parquet file, evaluating a held-out set saved with Hugging Face
`datasets` every step (greedy). Checks: every step trains on prompts x group_size sequences
with finite metrics, run D (colocation, Parquet, evaluation) trains exactly as A, its held-out
evaluation at step 0 equals transformers' own greedy decoding, the engines serve the pushed
weights (per-tensor checksums of sent vs engine-held tensors) at the right version, and the
resumed run reproduces the uninterrupted one.

A SIGKILLed job (a rank killed mid-rollout, mid-backward, mid-checkpoint, the launcher too)
leaving no process behind, engines included, and resuming to the uninterrupted run's metrics
and weights is the fault chain's (test_faults_e2e.py; it was also run B here: a launch of its
own killed after its step-2 checkpoint, resumed by C).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gspo.testing.jobs import torchrun_command
from tests.train.reference import GROUP, PROMPTS, ROOT, STEPS

pytestmark = pytest.mark.multirank
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}


def _command(
    tmp: Path, name: str, ckpt: str, steps: int, *extra: str, module: str = "megatron_gspo.train"
) -> list[str]:
    sets = {
        "model.hf_path": f"{_toy(tmp)}/model",
        "data.train_path": f"{_toy(tmp)}/toy.jsonl",
        "logging.dir": f"{tmp}/{name}",
        "checkpoint.dir": f"{tmp}/{ckpt}",
        "train.steps": steps,
        "rl.prompts_per_rollout": PROMPTS,
        "rl.group_size": GROUP,
        "logging.tensorboard": "false",
        "logging.progress": "false",
        # the distributed optimizer (the GPU default) also for its checkpoint/resume path; the
        # plain one is covered by tests/megatron/test_checkpoint.py
        "optim.use_distributed_optimizer": "true",
        "weights.verify_every": 1,  # the checks below read every step's push as verified
    }
    # a free master port: concurrent runs of this test must not collide
    cmd = torchrun_command(ROOT / "examples/tiny_moe_cpu.yaml", module=module)
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd + list(extra)


def _toy(tmp: Path) -> Path:
    """The reference run's toy: the runs here live in <its tmp>/e2e and are compared with it."""
    return tmp.parent / "toy"


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train(tmp: Path, name: str, ckpt: str, steps: int, *extra: str) -> list[dict]:
    cmd = _command(tmp, name, ckpt, steps, "--set", "checkpoint.save_every=0", *extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return _metrics(tmp / name)


@pytest.fixture(scope="module")
def runs(reference_run: dict[str, Any]) -> dict:
    tmp = reference_run["tmp"] / "e2e"
    tmp.mkdir()
    assert _toy(tmp) == reference_run["toy"]
    out: dict[str, Any] = {"a": _metrics(reference_run["dir"]), "a_dir": reference_run["dir"]}
    # A's step-2 checkpoint, as `latest` of a checkpoint directory of C's own
    shutil.copytree(reference_run["dir"] / "ckpt/step_000002", tmp / "ckpt_c/step_000002")
    (tmp / "ckpt_c/latest").write_text("step_000002\n")
    data = _parquet_and_held_out(tmp)

    def resumed_then_colocated() -> None:
        out["c"] = _train(tmp, "c", "ckpt_c", 4, "--resume")
        out["d"] = _train(
            tmp,
            "d",
            "ckpt_d",
            2,
            *("--set", "rollout.launch.colocated=true", "--set", "data.format=auto"),
            *("--set", f"data.train_path={data}/toy.parquet", "--set", "eval.every=1"),
            *("--set", f"eval.path={data}/held_out"),
        )

    def non_finite_then_resumed() -> None:
        extra = ("--set", "train.max_bad_steps=2", "--set", "checkpoint.save_every=0")
        cmd = _command(tmp, "nan", "ckpt_nan", 5, *extra, module="tests.train.nan_train")
        out["nan"] = subprocess.run(
            cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
        )
        # the checkpoint of a run that never stepped its optimizer resumes (a healthy loss now)
        out["nan_resumed"] = _train(tmp, "nan", "ckpt_nan", 3, "--resume")

    # Two lanes at once: one launch leaves ~25% of the 2 cores idle (measured), and the lanes
    # share nothing but the toy.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for lane in [pool.submit(resumed_then_colocated), pool.submit(non_finite_then_resumed)]:
            lane.result()
    out["tmp"] = tmp
    return out


def _parquet_and_held_out(tmp: Path) -> Path:
    """toy.jsonl as a Parquet file (pyarrow), and 6 held-out 3-digit copies saved with
    `datasets`' save_to_disk (the training prompts have 1-2 digits)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_gspo.data.toy import write_toy_dataset

    out = tmp / "data"
    rows = [json.loads(line) for line in (_toy(tmp) / "toy.jsonl").read_text().splitlines()]
    out.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), out / "toy.parquet")
    held = write_toy_dataset(out / "held.jsonl", 6, seed=1, ops=("copy",), min_len=3, max_len=3)
    held_rows = [json.loads(line) for line in held.read_text().splitlines()]
    datasets.Dataset.from_list(held_rows).save_to_disk(str(out / "held_out"))
    return out


def test_every_step_trains_full_groups_with_finite_metrics(runs) -> None:
    a = runs["a"]
    assert [m["step"] for m in a] == list(range(1, STEPS + 1))
    for m in a:
        assert m["rollout/num_samples"] == PROMPTS * GROUP
        assert m["rollout/num_rejected"] == 0
        for k in (
            "loss",
            "grad_norm",
            "reward/mean",
            "policy/clip_frac",
            "policy/entropy",
            "mismatch/abs_logp_diff",
            "time/rollout_s",
            "time/train_s",
            "time/sync_s",
        ):
            assert math.isfinite(m[k]), (m["step"], k)
        # before its first update the trainer IS the engine's policy: only numerical mismatch
        # (mismatch/* is measured on the first mini-batch only)
        assert m["mismatch/abs_logp_diff"] < 1e-4
        assert m["mismatch/seq_outside_clip"] == 0.0  # fp32 engine and trainer agree
        assert m["drift/abs_logp_diff"] > m["mismatch/abs_logp_diff"]  # later: the policy moved
        assert m["train/skipped_updates"] == 0 and m["optim/lr"] == 3e-3
        # routing drift is measured every step on real tokens (EP=2: both ranks' tokens)
        assert 0.0 <= m["moe/routing_flip_rate"] <= 1.0 and m["moe/routed_token_layers"] > 0


def test_engines_serve_the_pushed_weights(runs) -> None:
    for m in runs["a"]:
        assert m["weights/verified"] == 1.0  # per-tensor checksums: sent == engine-held
        assert m["weights/version"] == m["step"] + 1  # version 1 is the initial push


def test_final_hf_export_equals_the_converted_last_checkpoint(runs) -> None:
    """Two paths to a HF model of the trained policy agree bitwise: the trainer's export at the
    end (EP=2 job) and tools/convert_megatron_to_hf.py on its last checkpoint (one rank)."""
    from safetensors.torch import load_file

    tmp, a_dir = runs["tmp"], runs["a_dir"]
    out = tmp / "converted"
    last = a_dir / f"ckpt/step_{STEPS:06d}"
    cmd = [sys.executable, "tools/convert_megatron_to_hf.py", "-i", str(last)]
    proc = subprocess.run(
        [*cmd, "-o", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    def weights(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    exported, converted = weights(a_dir / "ckpt/hf_final"), weights(out)
    initial = weights(_toy(tmp) / "model")
    assert exported.keys() == converted.keys() == initial.keys()
    for k in exported:
        assert torch.equal(exported[k], converted[k]), k
    assert any(not torch.equal(exported[k], initial[k]) for k in exported)  # it did train


def test_colocated_release_and_resume_change_nothing(runs) -> None:
    """rollout.launch.colocated: the engines free their memory during each update (the embedded
    engine then refuses to generate) and get it back before the weight push and the next rollout.
    Run D also reads its prompts from Parquet and evaluates between steps: neither changes
    what it trains."""
    trained = [m for m in runs["d"] if m["step"] > 0]
    for got, want in zip(trained, runs["a"][:2], strict=True):
        assert got["weights/verified"] == 1.0
        for k in ("loss", "reward/mean", "grad_norm", "policy/clip_frac"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (got["step"], k)


def test_resume_continues_exactly(runs) -> None:
    a, c = runs["a"], runs["c"]
    assert [m["step"] for m in c] == [3, 4]
    for got, want in zip(c, a[2:4], strict=True):
        for k in ("loss", "reward/mean", "grad_norm", "policy/clip_frac", "moe/routing_flip_rate"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (got["step"], k)


def test_non_finite_steps_are_skipped_logged_and_stop_the_job(runs) -> None:
    """Planted NaN loss (tests/train/nan_train.py): each optimizer step is skipped, the NaN is
    in metrics.jsonl (not dropped), the engines keep finite weights, and after
    train.max_bad_steps=2 bad steps the job checkpoints and exits non-zero saying why."""
    from megatron_gspo.run.metrics_log import read_metrics

    proc, tmp = runs["nan"], runs["tmp"]
    assert proc.returncode != 0
    assert "2 consecutive steps (up to step 2) had a non-finite loss" in proc.stderr
    assert "checkpoint written at step 2" in proc.stderr
    assert (tmp / "ckpt_nan/step_000002/trainer_rank0.pt").is_file()  # written at the stop
    assert (tmp / "ckpt_nan/latest").read_text().strip() == "step_000003"  # and resumed
    rows = read_metrics(tmp / "nan" / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3]
    assert math.isfinite(rows[3]["loss"]) and rows[3]["train/skipped_updates"] == 0
    for m in (rows[1], rows[2]):
        assert math.isnan(m["loss"]) and math.isnan(m["grad_norm"])
        assert m["train/skipped_updates"] == 4  # every mini-batch
        assert m["weights/verified"] == 1.0  # the engines hold the (unchanged, finite) weights


def test_held_out_evaluation_every_step_equals_greedy_decoding_at_step_0(runs) -> None:
    """eval.every=1 on a `datasets` directory: step 0 (before training) and every step log the
    held-out metrics; step 0's equal the toy reward of transformers' own greedy decoding of
    the initial model; the plotting tool draws them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_gspo.data.formats import load_prompt_records
    from megatron_gspo.data.prompts import PromptDataset
    from megatron_gspo.rewards.toy import toy_reward
    from megatron_gspo.run.metrics_log import read_metrics
    from tools import plot_metrics

    tmp = runs["tmp"]
    rows = read_metrics(tmp / "d/metrics.jsonl")
    assert sorted(rows) == [0, 1, 2]
    assert {k for k in rows[0] if not k.startswith("eval/")} == {"step", "time"}  # eval only
    for m in rows.values():
        assert m["eval/num_prompts"] == 6 and m["eval/failed"] == 0
        assert m["eval/reward_failures"] == 0 and 0 <= m["eval/pass@1"] <= 1
    tok = AutoTokenizer.from_pretrained(_toy(tmp) / "model")
    model = AutoModelForCausalLM.from_pretrained(_toy(tmp) / "model", dtype=torch.float32).eval()
    held = PromptDataset(
        load_prompt_records(tmp / "data/held_out", fmt="hf"), tok, chat_template=False
    )
    rewards = []
    for record in held:
        ids = torch.tensor([held.encode(record)])
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id
            )
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        rewards.append(toy_reward(record.prompt, text, record.answer))
    assert rows[0]["eval/reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
    assert rows[0]["eval/pass@1"] == pytest.approx(sum(r >= 1 for r in rewards) / len(rewards))
    png = tmp / "d/reward.png"
    assert plot_metrics.main([str(tmp / "d/metrics.jsonl"), "--out", str(png)]) == 0
    assert png.stat().st_size > 0
    assert plot_metrics.default_keys(set(rows[1]))[:3] == [
        "reward/mean",
        "eval/reward_mean",
        "eval/pass@1",
    ]
