"""The planner (`python -m megatron_gspo.plan`): its per-rank parameter counts are megatron-core's
(the tiny model built for real on gloo ranks holds exactly as many parameters per rank), its
memory table is printed with the formula, and each invalid layout is refused naming the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks

pytestmark = pytest.mark.multirank
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
TINY = str(ROOT / "examples/tiny_moe_cpu.yaml")
# Two ranks: every way the tiny model (4 heads / 2 kv heads, 4 experts, 2 layers) can be split.
LAYOUTS = [
    {"tp": 2},
    {"ep": 2},
    {"pp": 2},
    {"tp": 2, "ep": 2, "etp": 1},
    {},  # data parallel: every rank holds the whole model
]


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("plan") / "model")


def test_param_counts_equal_the_built_model_per_rank(tiny: Path) -> None:
    real = spawn_ranks(_real_counts, 2, str(tiny), LAYOUTS)
    # The planner counts in its own process (it builds on `meta` in a fake process group).
    code = (
        "import json; from megatron_gspo.plan.planner import count_params; "
        "from megatron_gspo.layout import Layout; "
        f"print(json.dumps([[vars(s) for s in count_params({str(tiny)!r}, Layout(**l), 2)] "
        f"for l in {LAYOUTS!r}]))"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = json.loads(proc.stdout.strip().splitlines()[-1])
    for layout, stages, per_rank in zip(LAYOUTS, planned, zip(*real), strict=True):
        for r in per_rank:  # each real rank equals the planner's count for its stage
            s = stages[r["stage"]]
            assert (s["total"], s["expert"]) == (r["total"], r["expert"]), (layout, r, s)
    # the counts depend on the layout: a planner that ignored it would not pass the above
    whole = planned[-1][0]
    assert planned[0][0]["total"] < whole["total"]  # tp2
    assert planned[1][0]["expert"] * 2 == whole["expert"]  # ep2: half the experts per rank
    assert planned[2][0]["total"] + planned[2][1]["total"] == whole["total"]  # pp2


def _real_counts(rank: int, world: int, hf_dir: str, layouts: list[dict]) -> list[dict]:
    from tests.plan.plan_ranks import real_param_counts

    return real_param_counts(rank, world, hf_dir, layouts)


def _plan_cli(tiny: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_gspo.plan", "--config", TINY]
    cmd += ["--set", f"model.hf_path={tiny}", "--set", f"data.train_path={tmp}/x.jsonl", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_cli_prints_table_formula_and_verdict(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = _plan_cli(
        tiny,
        tmp_path,
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--gpu-mem-gb",
        "8",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for word in (
        "params/rank stage 0",
        "optimizer",
        "activations",
        "weight sync/step",
        "verdict: FITS",
        "grads       = 4 * P",
        "assumptions:",
    ):
        assert word in proc.stdout, word
    plan = json.loads(out.read_text())
    (stage,) = plan["stages"]
    m = plan["memory_gb"]
    # fp32 on CPU (no main copy), Adam (8 B), distributed optimizer: dense state sharded over
    # dp=2, expert state over expert-dp = 2 / ep2 = 1
    assert plan["dp"] == 2 and plan["expert_dp"] == 1
    assert m["weights"] == pytest.approx(4 * stage["total"] / 2**30)
    assert m["grads"] == pytest.approx(4 * stage["total"] / 2**30)
    assert m["optimizer"] == pytest.approx(8 * (stage["dense"] / 2 + stage["expert"]) / 2**30)
    # a 2 GiB GPU cannot hold the 3 GiB per-process overhead, the verdict says so (exit 1)
    small = _plan_cli(tiny, tmp_path, "--nodes", "1", "--gpus-per-node", "2", "--gpu-mem-gb", "2")
    assert small.returncode == 1 and "DOES NOT FIT" in small.stdout, small.stdout


# Each invalid case and the config key its message must name.
INVALID = [
    ({"parallel.tp": 3}, 1, 2, "parallel.tp"),  # world 2 not divisible by 3
    ({"parallel.ep": 3}, 1, 3, "parallel.ep"),  # 3 does not divide 4 experts
    ({"parallel.tp": 4, "parallel.ep": 1}, 1, 4, "parallel.tp"),  # 2 kv heads
    ({"parallel.pp": 4, "parallel.ep": 1}, 1, 4, "parallel.pp"),  # 2 layers
    ({"parallel.ep": 4}, 1, 2, "parallel.ep"),  # expert grid 4 does not divide 2 ranks
    ({"parallel.vpp": 2, "parallel.pp": 2, "parallel.ep": 1}, 1, 2, "parallel.vpp"),
    ({"parallel.dp": 4}, 1, 2, "parallel.dp"),
    (
        {"rollout.launch.tp_size": 3, "rollout.launch.backend": "sglang"},
        1,
        6,
        "rollout.launch.tp_size",
    ),  # 3 does not divide 4 heads
    (
        {"rollout.launch.tp_size": 4, "rollout.launch.backend": "sglang"},
        1,
        2,
        "rollout.launch.tp_size",
    ),  # more GPUs than a node has
    (
        {"rollout.launch.ep_size": 3, "rollout.launch.backend": "sglang"},
        1,
        2,
        "rollout.launch.ep_size",
    ),
]


def test_invalid_layouts_are_refused_naming_the_key(tiny: Path, tmp_path: Path) -> None:
    cases = [
        ([f"{k}={v}" for k, v in sets.items()], nodes, gpus) for sets, nodes, gpus, _ in INVALID
    ]
    code = f"""
import json
from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.plan.planner import make_plan
out = []
for sets, nodes, gpus in {cases!r}:
    sets += ["model.hf_path={tiny}", "data.train_path=x.jsonl"]
    try:
        make_plan(load_config({TINY!r}, sets), nodes=nodes, gpus_per_node=gpus, gpu_mem_gb=80)
        out.append("ACCEPTED")
    except ConfigError as e:
        out.append(str(e))
print(json.dumps(out))
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    messages = json.loads(proc.stdout.strip().splitlines()[-1])
    for (sets, _, _, key), msg in zip(INVALID, messages, strict=True):
        assert msg != "ACCEPTED", sets
        assert key in msg, (sets, msg)
    # the CLI: exit 2 with the message, before building anything
    proc = _plan_cli(
        tiny,
        tmp_path,
        "--set",
        "parallel.ep=3",
        "--nodes",
        "1",
        "--gpus-per-node",
        "3",
        "--gpu-mem-gb",
        "80",
    )
    assert proc.returncode == 2 and "parallel.ep" in proc.stderr, proc.stderr[-2000:]
