"""Held-out evaluation (`rollout/evaluation.py`): the pass@k estimator against enumerating
every k-subset, and an `Evaluator` over a scripted engine against rewards and pass@k computed
here from the toy reward directly; its schedule, its sampling, and an engine failure."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from megatron_gspo.config_io import ConfigError
from megatron_gspo.data.prompts import PromptDataset, PromptRecord
from megatron_gspo.engines.protocols import EngineError
from megatron_gspo.engines.types import RolloutResult, RolloutStats, Sample, SamplingParams
from megatron_gspo.rewards.pool import RewardPool
from megatron_gspo.rewards.toy import toy_reward
from megatron_gspo.rollout.evaluation import EvalConfig, Evaluator, pass_at_k, summarize


def _subset_pass(solved: list[bool], k: int) -> Fraction:
    """pass@k by definition: the share of k-subsets of the samples holding a solved one."""
    subsets = list(itertools.combinations(solved, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_solved_sample(n):
    for c in range(n + 1):
        solved = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_subset_pass(solved, k)), abs=1e-15)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


# Responses the scripted engine returns: prompt i, sample j (digits of the toy tokenizer).
PROMPTS = [("copy 12=", "12"), ("copy 7=", "7"), ("copy 45=", "45")]
TEXTS = [["12", "1", "12", "2"], ["3", "8", "9", "70"], ["45", "45", "45", "4"]]


class ScriptedEngine:
    """`agenerate` answering TEXTS (tokenised), recording what it was asked."""

    def __init__(self, tokenizer, fail: bool = False) -> None:
        self.tokenizer, self.fail = tokenizer, fail
        self.calls: list[tuple[int, SamplingParams, int]] = []

    async def agenerate(self, prompts, sampling, *, n=1):
        self.calls.append((len(prompts), sampling, n))
        if self.fail:
            raise EngineError("every engine refused")
        samples = []
        for i, p in enumerate(prompts):
            for j in range(n):
                ids = self.tokenizer(TEXTS[i][j], add_special_tokens=False)["input_ids"]
                samples.append(
                    Sample(
                        prompt_ids=list(p),
                        response_ids=ids,
                        logprobs=[0.0] * len(ids),
                        logprob_mask=[True] * len(ids),
                        finish_reason="stop" if j % 2 == 0 else "length",
                        truncated=j % 2 == 1,
                        prompt_index=i,
                        sample_index=j,
                        weight_version="1",
                        engine_id="scripted",
                    )
                )
        return RolloutResult(samples=samples, stats=RolloutStats())


def _evaluator(tokenizer, k: int, fail: bool = False, every: int = 2) -> Evaluator:
    records = [PromptRecord(index=i, prompt=p, answer=a) for i, (p, a) in enumerate(PROMPTS)]
    cfg = EvalConfig(every=every, path="held_out.jsonl", samples_per_prompt=k, temperature=0.7)
    return Evaluator(
        cfg,
        engine=ScriptedEngine(tokenizer, fail),
        dataset=PromptDataset(records, tokenizer, chat_template=False),
        rewards=RewardPool("toy", num_workers=0),
        sampling=SamplingParams(max_new_tokens=5, temperature=0.7, seed=3),
        total_steps=5,
    )


@pytest.mark.parametrize("k", [1, 4])
def test_evaluate_reports_the_mean_reward_and_pass_at_k_of_the_held_out_set(toy_tokenizer, k):
    ev = _evaluator(toy_tokenizer, k)
    got = ev.evaluate()
    rewards = [
        [toy_reward(p, TEXTS[i][j], a) for j in range(k)] for i, (p, a) in enumerate(PROMPTS)
    ]
    flat = [r for row in rewards for r in row]
    assert got["eval/reward_mean"] == pytest.approx(math.fsum(flat) / len(flat), rel=1e-12)
    for kk in {1, k}:
        want = sum(_subset_pass([r >= 1.0 for r in row], kk) for row in rewards) / len(rewards)
        assert got[f"eval/pass@{kk}"] == pytest.approx(float(want), rel=1e-12)
    assert ("eval/pass@4" in got) == (k == 4)
    assert got["eval/num_prompts"] == 3 and got["eval/failed"] == 0.0
    assert got["eval/truncated_frac"] == pytest.approx(sum(j % 2 for j in range(k)) / k)
    # every held-out prompt once per call, k samples each, at the evaluation's sampling
    ((num_prompts, sampling, n),) = ev.engine.calls
    assert (num_prompts, n, sampling.temperature, sampling.max_new_tokens) == (3, k, 0.7, 5)


def test_schedule_and_an_engine_failure_that_does_not_stop_training(toy_tokenizer, capsys):
    ev = _evaluator(toy_tokenizer, 1, fail=True, every=2)
    assert [s for s in range(6) if ev.due(s)] == [0, 2, 4, 5]  # every 2, and the last step
    assert ev.maybe_run(3) == {} and ev.engine.calls == []
    got = ev.maybe_run(4)  # the engines fail: logged, not raised
    assert got["eval/failed"] == 1.0 and "eval/reward_mean" not in got
    assert "[eval] skipped" in capsys.readouterr().err
    off = _evaluator(toy_tokenizer, 1, every=0)
    assert not any(off.due(s) for s in range(6))


def test_a_prompt_with_fewer_samples_counts_with_what_it_has():
    # prompt 0: 3 samples, one solved; prompt 1: 1 sample (the client rejected 2), solved
    got = summarize([0, 0, 0, 1], [1.0, 0.2, 0.0, 1.0], 3, 1.0)
    assert got["eval/pass@1"] == pytest.approx((1 / 3 + 1) / 2)
    assert got["eval/pass@3"] == pytest.approx((1 + 1) / 2)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"every": 5}, "eval.path"),
        ({"every": 5, "path": "x", "samples_per_prompt": 4}, "eval.temperature"),
        ({"every": -1}, "eval.every"),
    ],
)
def test_config_refuses_what_cannot_run(kwargs, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        EvalConfig(**kwargs)
