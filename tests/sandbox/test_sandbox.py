"""Reward workers are sandboxed (issue 15): user code runs only in worker processes, with a
scrubbed environment and memory / CPU limits; a worker that hits a limit is replaced, the call
scores 0 with a message naming the limit, and the pool goes on."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.rewards import RewardPool, build_reward_pool
from megatron_gspo.sandbox.process import WorkerLimits, worker_env

FIX = __name__.rpartition(".")[0] + ".sandbox_fixtures"
BASE = ["model.hf_path=/m", "data.train_path=/d.jsonl"]


def test_user_code_runs_only_in_workers():
    """The reward runs in a worker (its pid is a worker's, not ours) and the trainer never
    imports the user module (was: `RewardPool` imported it in rank 0 to check the spec)."""
    sys.modules.pop(FIX, None)
    with RewardPool(f"{FIX}:pid", num_workers=2, timeout_s=30) as pool:
        batch = pool.score(["p"] * 4, ["r"] * 4, ["a"] * 4)
        pids = set(pool.worker_pids)
    assert {int(r) for r in batch.rewards} <= pids and os.getpid() not in pids
    assert FIX not in sys.modules
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        RewardPool(f"{FIX}:nope", num_workers=1)  # the worker's message, at start-up
    with pytest.raises(ValueError, match="only in worker processes"):
        RewardPool(f"{FIX}:pid", num_workers=0)


def test_memory_limit_stops_the_call_and_the_worker_is_replaced():
    limits = WorkerLimits(max_memory_mb=400)
    with RewardPool(f"{FIX}:hog", num_workers=1, timeout_s=60, limits=limits) as pool:
        before = pool.worker_pids
        batch = pool.score(["p"] * 3, ["10", "1000", "10"], ["a"] * 3)
        after = pool.worker_pids
    assert batch.rewards == [1.0, 0.0, 1.0] and batch.failures == 1 and batch.timeouts == 0
    assert "sandbox.max_memory_mb=400" in batch.errors[0] and "MemoryError" in batch.errors[0]
    assert before != after  # replaced, and the call after it ran
    report = batch.report()
    assert report is not None and "sandbox.max_memory_mb=400" in report and "1 of 3" in report
    # Without the limit the same allocation goes through: the limit is what stopped it.
    with RewardPool(
        f"{FIX}:hog", num_workers=1, timeout_s=60, limits=WorkerLimits(max_memory_mb=None)
    ) as pool:
        assert pool.score(["p"], ["1000"], ["a"]).rewards == [1.0]


def test_cpu_limit_kills_a_busy_loop_inside_the_wall_timeout():
    """Two threads spinning: killed by RLIMIT_CPU (SIGXCPU) long before the 120 s wall
    timeout, counted as a failure (not a timeout), and the next call runs on a new worker."""
    limits = WorkerLimits(max_cpu_s=1.0)
    with RewardPool(f"{FIX}:spin", num_workers=1, timeout_s=120, limits=limits) as pool:
        pool.score(["p"], ["ok"], ["a"])
        batch = pool.score(["p"] * 2, ["2", "ok"], ["a"] * 2)
    assert batch.rewards == [0.0, 1.0] and batch.failures == 1 and batch.timeouts == 0
    assert "SIGXCPU" in batch.errors[0] and "sandbox.max_cpu_s=1" in batch.errors[0]


def test_workers_do_not_see_the_trainers_secrets(monkeypatch):
    monkeypatch.setenv("MGSPO_TEST_SECRET", "hunter2")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-planted")
    env = worker_env()
    assert "MGSPO_TEST_SECRET" not in env and "OPENAI_API_KEY" not in env and "PATH" in env
    with RewardPool(f"{FIX}:secret", num_workers=1, timeout_s=30) as pool:
        assert pool.score(["p"], ["r"], ["a"]).rewards == [0.5]
    # sandbox.pass_env lets a named variable through (and only that one is the way in)
    cfg = load_config(
        None,
        [
            *BASE,
            f"reward.kind={FIX}:secret",
            "reward.num_workers=1",
            "sandbox.pass_env=[MGSPO_TEST_SECRET]",
        ],
    )
    with build_reward_pool(cfg.reward, cfg.sandbox) as pool:
        assert pool.score(["p"], ["r"], ["a"]).rewards == [1.0]


def test_limit_keys_reach_the_workers():
    """sandbox.max_memory_mb / max_cpu_s / pass_env from the config become the pool's limits;
    max_cpu_s defaults to twice the wall timeout."""
    cfg = load_config(
        None,
        [
            *BASE,
            "reward.kind=toy",
            "sandbox.max_memory_mb=300",
            "sandbox.max_cpu_s=7",
            "reward.timeout_s=4",
        ],
    )
    with build_reward_pool(cfg.reward, cfg.sandbox) as pool:
        assert pool.limits == WorkerLimits(max_memory_mb=300, max_cpu_s=7.0, pass_env=())
    cfg = load_config(
        None, [*BASE, "reward.kind=toy", "reward.timeout_s=4", "reward.num_workers=0"]
    )
    with build_reward_pool(cfg.reward, cfg.sandbox) as pool:
        assert pool.limits.max_cpu_s == 8.0 and pool.limits.max_memory_mb == 8192
    with pytest.raises(ConfigError, match="set reward.num_workers >= 1"):
        load_config(None, [*BASE, f"reward.kind={FIX}:pid", "reward.num_workers=0"])
    with pytest.raises(ConfigError, match="change sandbox.max_memory_mb"):
        load_config(None, [*BASE, "sandbox.max_memory_mb=0"])
