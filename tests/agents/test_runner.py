"""`rollout.agent`: user agents in sandbox workers, each with a real OpenAI client on the
endpoint; one token-exact training sample per episode, failures marked and counted."""

from __future__ import annotations

import asyncio
import os

import pytest

from megatron_gspo.agents.runner import AgentPool, AgentRollout
from megatron_gspo.engines.types import SamplingParams
from megatron_gspo.sandbox.process import WorkerLimits
from tests.agents.fixtures import QUESTION, check_token_exact

FIX = "tests.agents.agent_fixtures"
SP = SamplingParams()


def _run(stack, spec: str, record: dict, n: int = 2):
    endpoint, proxy, _ = stack
    pool = AgentPool(
        f"{FIX}:{spec}", num_workers=2, timeout_s=300, limits=WorkerLimits(max_memory_mb=4096)
    )
    try:
        rollout = AgentRollout(pool, endpoint.store, endpoint.url)
        since = len(proxy.calls)
        samples = asyncio.run(rollout.group_fn(record, [], SP, n, 3))
        return samples, rollout, proxy.engine_turns(since), pool.worker_pids
    finally:
        pool.close()


def test_agent_episodes_are_token_exact_samples(stack):
    samples, rollout, turns, _ = _run(stack, "tool_agent", {"prompt": QUESTION, "answer": "5"})
    assert [s.sample_index for s in samples] == [0, 1]
    assert all(s.failed is None and s.env_reward == 1.0 for s in samples)
    unique = list(dict.fromkeys((tuple(i), tuple(o), tuple(lp)) for i, o, lp in turns))
    assert len(unique) == 2  # greedy: both episodes made the same two engine turns
    for s in samples:
        assert s.prompt_index == 3 and s.meta["num_model_turns"] == 2
        check_token_exact(s, [(list(i), list(o), list(lp)) for i, o, lp in unique])
    assert rollout.counts["episodes"] == 2 and rollout.counts["continued"] == 2
    assert not rollout.store.ids() or all(
        not t.startswith("p3-") for t in rollout.store.ids()
    )  # taken from the store


def test_agents_run_in_the_sandbox(stack, tmp_path):
    pid_file = tmp_path / "pid"
    samples, _, _, pids = _run(
        stack, "pid_agent", {"prompt": "x", "meta": {"pid_file": str(pid_file)}}, n=1
    )
    (s,) = samples
    assert s.failed is None and s.env_reward is None  # left to reward.kind
    assert int(pid_file.read_text()) in pids and int(pid_file.read_text()) != os.getpid()


@pytest.mark.parametrize(
    "spec, why", [("failing_agent", "the agent broke"), ("idle_agent", "no chat-completion call")]
)
def test_failed_agents_are_marked_and_counted(stack, spec, why):
    samples, rollout, _, _ = _run(stack, spec, {"prompt": "x"})
    assert all(s.failed and why in s.failed for s in samples)
    assert rollout.counts["failed"] == 2 and why in rollout.errors[0]


def _cfg(*extra: str):
    from megatron_gspo.config import load_config

    return load_config(
        None,
        [
            "model.hf_path=/m",
            "data.train_path=/d.jsonl",
            "rollout.max_new_tokens=128",
            "rollout.temperature=0.05",  # forced on the agent; near-greedy: the memorised path
            "reward.kind=toy",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    "extra, key",
    [
        (["rollout.agent=no_function"], "rollout.agent"),
        ([f"rollout.agent={FIX}:tool_agent", "rollout.env=a:B"], "rollout.env"),
        ([f"rollout.agent={FIX}:tool_agent", "rollout.agent_workers=0"], "agent_workers"),
    ],
)
def test_bad_agent_configs_name_the_key(extra, key):
    from megatron_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=key):
        _cfg(*extra)


def test_the_job_wiring_forces_the_rollout_sampling(stack):
    """`make_agent_rollout` (what `make_rollout` calls for rollout.agent): its own endpoint
    samples at rollout.temperature whatever the agent asks (the agent asks 0.0, the rollout
    says 0.05)."""
    from megatron_gspo.agents.runner import make_agent_rollout

    endpoint, proxy, tok = stack
    cfg = _cfg(f"rollout.agent={FIX}:tool_agent", "rollout.agent_workers=1")
    group_fn, rollout = make_agent_rollout(cfg, endpoint.generator, tok)
    try:
        since = len(proxy.calls)
        (s,) = asyncio.run(group_fn({"prompt": QUESTION, "answer": "5"}, [], SP, 1, 0))
        bodies = [b for b, _ in proxy.calls[since:]]
        assert bodies and all(
            sp["temperature"] == 0.05 and sp["max_new_tokens"] <= 128
            for b in bodies
            for sp in (
                [b["sampling_params"]]
                if isinstance(b["sampling_params"], dict)
                else b["sampling_params"]
            )
        )
        assert s.failed is None
        metrics, report = rollout.take_report()
        assert metrics["agent/episodes"] == 1.0 and report is None
    finally:
        rollout.close()


def test_a_rollout_step_trains_on_the_agents_tokens(stack):
    """The RL side end to end (`Rollout.next_batch` over the agent `group_fn`): each training
    sequence is one episode, trained on exactly the engine's tokens with its log-probs as
    pi_old, rewarded by the agent; `agent/*` metrics logged."""
    from types import SimpleNamespace

    from megatron_gspo.agents.runner import make_agent_rollout
    from megatron_gspo.data.prompts import PromptDataset, PromptLoader, PromptRecord
    from megatron_gspo.rewards import RewardPool
    from megatron_gspo.rollout.experience import Rollout

    endpoint, proxy, tok = stack
    cfg = _cfg(
        f"rollout.agent={FIX}:tool_agent",
        "rl.group_size=2",
        "rl.prompts_per_rollout=1",
        "rl.mini_batches_per_rollout=1",
        "reward.num_workers=0",
    )
    dataset = PromptDataset([PromptRecord(index=0, prompt=QUESTION, answer="5")], tok)
    loader = PromptLoader(dataset, 1, seed=0, shuffle=False)
    group_fn, agents = make_agent_rollout(cfg, endpoint.generator, tok)
    ro = Rollout(
        cfg.rollout_spec(),
        endpoint.generator,
        tok,
        loader,
        RewardPool("toy", num_workers=0),
        group_fn=group_fn,
        envs=agents,
    )
    since = len(proxy.calls)
    try:
        seqs, metrics = ro.next_batch()
    finally:
        ro.close()
    turns = proxy.engine_turns(since)
    assert len(seqs) == 2 and metrics["agent/episodes"] == 2 and metrics["agent/failed"] == 0
    for seq in seqs:
        full = list(seq.prompt_ids) + list(seq.response_ids)
        mine = [t for t in turns if full[: len(t[0]) + len(t[1])] == t[0] + t[1]]
        mine = [list(map(list, t)) for t in dict.fromkeys(tuple(map(tuple, t)) for t in mine)]
        as_sample = SimpleNamespace(
            prompt_ids=list(seq.prompt_ids),
            response_ids=list(seq.response_ids),
            logprobs=list(seq.old_logp),
            logprob_mask=[bool(m) for m in seq.loss_mask],
        )
        assert mine  # the tool call and the answer, when sampled as memorised
        check_token_exact(as_sample, mine)
        assert seq.reward in (0.0, 1.0)  # the agent's own reward, not toy_reward's partial credit
