"""Periodic evaluation on held-out prompts, by the rollout engines, between training steps.

Every `eval.every` steps (after the step's weight push, so on the weights just trained), once
before the first step (step 0) and after the last one, rank 0 sends every prompt of `eval.path`
to the engines, `eval.samples_per_prompt` = k samples each (greedy at `eval.temperature` 0),
scores them with `reward.kind` in a reward pool of its own (the rollout's may be busy scoring
the next batch in asynchronous mode) and returns, for the metrics of that step:

    eval/reward_mean     mean reward over all N * k samples
    eval/pass@1          mean over prompts of pass@1 (c_i / k)
    eval/pass@k          (k > 1; the key names k, e.g. eval/pass@4) mean over prompts of
                         pass_at_k(n_i, c_i, k): with n_i = k samples, 1 if any is solved
    eval/num_prompts, eval/response_length_mean, eval/truncated_frac, eval/time_s,
    eval/reward_failures, eval/reward_timeouts, eval/failed (1 when an engine error ended it)

where c_i counts the samples of prompt i whose reward is >= `eval.pass_threshold` ("solved").
`pass_at_k(n, c, k)` is the estimator of Chen et al. 2021 (unbiased for any k <= n). Requests go
through the rollout's own event loop (`RolloutDriver.loop`), so the client is only ever used
from one thread. An engine failure during evaluation is reported and logged
(`eval/failed`), never raised: training goes on and the next rollout deals with the engines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_gspo.config_io import positive as _positive
from megatron_gspo.config_io import require as _require
from megatron_gspo.engines.protocols import EngineError, NoEnginesLeft, Sampler
from megatron_gspo.engines.types import RolloutResult, SamplingParams

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import PromptDataset
    from megatron_gspo.rollout.experience import Rollout

if TYPE_CHECKING:  # annotations only; rollout/spec.py imports EvalConfig from here
    from megatron_gspo.rewards.pool import RewardScorer
    from megatron_gspo.rollout.spec import RolloutSpec

__all__ = ["EvalConfig", "Evaluator", "build_evaluator", "pass_at_k"]


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation between steps (off by default)."""

    every: int = 0
    """Evaluate every N training steps (after the step's weight push), before the first step
    (step 0) and after the last; 0 = off."""
    path: str | None = None
    """Held-out prompts, read like data.train_path (data.format and the data.*_key fields)."""
    samples_per_prompt: int = 1
    """k: samples per held-out prompt; eval/pass@k is logged for k > 1 (needs temperature > 0)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation; 0 = greedy."""
    max_new_tokens: int | None = None
    """Response cap of evaluation; null = rollout.max_new_tokens."""
    pass_threshold: float = 1.0
    """A sample counts as solved (pass@k) when its reward is >= this."""

    def __post_init__(self) -> None:
        _require(self.every >= 0, f"eval.every={self.every} must be >= 0 (0 = off); change it")
        _require(
            self.every == 0 or bool(self.path),
            "eval.every > 0 needs held-out prompts; set eval.path",
        )
        _positive("eval", samples_per_prompt=self.samples_per_prompt)
        _positive("eval", max_new_tokens=self.max_new_tokens)
        _require(
            self.temperature >= 0,
            f"eval.temperature={self.temperature} must be >= 0 (0 = greedy); change it",
        )
        _require(
            self.samples_per_prompt == 1 or self.temperature > 0,
            f"eval.samples_per_prompt={self.samples_per_prompt} greedy samples are all the "
            "same; set eval.temperature > 0 or eval.samples_per_prompt=1",
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt from n samples of which c are correct (Chen et al. 2021):
    1 - C(n - c, k) / C(n, k), the chance that a random k-subset holds a correct sample."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Evaluator:
    """Generates and scores the held-out set on request (`maybe_run(step)`; rank 0 only)."""

    def __init__(
        self,
        cfg: EvalConfig,
        *,
        engine: Sampler,
        dataset: PromptDataset,  # a chat record has prompt None: rewards see it
        rewards: RewardScorer,
        sampling: SamplingParams,
        total_steps: int,
        run: Callable[[Coroutine[Any, Any, RolloutResult]], RolloutResult] = asyncio.run,
    ) -> None:
        """engine: has `agenerate(prompt_ids, sampling, n=)`; dataset: a `PromptDataset`
        (records, `encode`, tokenizer); rewards: has `score(prompts, responses, answers)`
        returning a `RewardBatch`; run: runs a coroutine to its end (the rollout's loop)."""
        self.cfg = cfg
        self.engine = engine
        self.dataset = dataset
        self.rewards = rewards
        self.sampling = sampling
        self.total_steps = total_steps
        self.run = run
        self.prompt_ids = [dataset.encode(r) for r in dataset]

    def due(self, step: int) -> bool:
        """Whether `step` (training steps done) is an evaluation step."""
        every = self.cfg.every
        return bool(every) and (step % every == 0 or step == self.total_steps)

    def maybe_run(self, step: int) -> dict[str, float]:
        """`evaluate()` at the evaluation steps, else nothing."""
        return self.evaluate() if self.due(step) else {}

    def evaluate(self) -> dict[str, float]:
        """Generate k samples per held-out prompt, score them, and summarise (module doc)."""
        k = self.cfg.samples_per_prompt
        tic = time.perf_counter()
        try:
            result = self.run(self.engine.agenerate(self.prompt_ids, self.sampling, n=k))
        except (EngineError, NoEnginesLeft) as e:
            print(f"[eval] skipped: the engines failed ({e})", file=sys.stderr, flush=True)
            return {"eval/failed": 1.0, "eval/time_s": time.perf_counter() - tic}
        samples = result.samples
        if not samples:  # every response was rejected by the client
            print("[eval] skipped: no valid response", file=sys.stderr, flush=True)
            return {"eval/failed": 1.0, "eval/time_s": time.perf_counter() - tic}
        tok = self.dataset.tokenizer
        assert tok is not None, "build_evaluator reads the dataset with the rollout's tokenizer"
        records = [self.dataset[s.prompt_index] for s in samples]
        texts = [tok.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        scored = self.rewards.score([r.prompt for r in records], texts, [r.answer for r in records])
        if (report := scored.report("eval reward")) is not None:
            print(report, file=sys.stderr, flush=True)
        metrics = summarize(
            [s.prompt_index for s in samples], scored.rewards, k, self.cfg.pass_threshold
        )
        lengths = [len(s.response_ids) for s in samples]
        return metrics | {
            "eval/response_length_mean": sum(lengths) / len(lengths),
            "eval/truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "eval/reward_failures": float(scored.failures),
            "eval/reward_timeouts": float(scored.timeouts),
            "eval/failed": 0.0,
            "eval/time_s": time.perf_counter() - tic,
        }

    def close(self) -> None:
        self.rewards.close()


def summarize(
    prompt_index: Sequence[int], rewards: Sequence[float], k: int, threshold: float
) -> dict[str, float]:
    """eval/reward_mean, eval/pass@1 and (k > 1) eval/pass@k from per-sample rewards, each
    sample tagged with its prompt. A prompt with n_i < k samples (the client rejected some)
    counts with pass_at_k(n_i, c_i, min(k, n_i)); a prompt with none is not counted."""
    solved: dict[int, int] = {}
    count: dict[int, int] = {}
    for p, r in zip(prompt_index, rewards, strict=True):
        count[p] = count.get(p, 0) + 1
        solved[p] = solved.get(p, 0) + (r >= threshold)

    def mean_pass(k: int) -> float:
        return sum(pass_at_k(count[p], solved[p], min(k, count[p])) for p in count) / len(count)

    out = {
        "eval/reward_mean": sum(rewards) / len(rewards),
        "eval/num_prompts": float(len(count)),
        "eval/pass@1": mean_pass(1),
    }
    if k > 1:
        out[f"eval/pass@{k}"] = mean_pass(k)
    return out


def build_evaluator(spec: RolloutSpec, rollout: Rollout | None) -> Evaluator | None:
    """The evaluator of a run (its `RolloutSpec`, `rollout/spec.py`) on rank 0's rollout; None
    when evaluation is off or on other ranks."""
    if rollout is None or not spec.eval.every:
        return None
    from megatron_gspo.data.prompts import PromptDataset
    from megatron_gspo.rewards.pool import build_reward_pool

    ev = spec.eval
    dataset = PromptDataset.from_config(spec.data, rollout.tokenizer, path=ev.path, key="eval.path")
    sampling = dataclasses.replace(
        rollout.sampling(),
        temperature=ev.temperature,
        max_new_tokens=ev.max_new_tokens or spec.rollout.max_new_tokens,
        seed=spec.seed * 7919 + 104_729,  # one seed for every evaluation: the weights differ
    )
    loop = rollout.driver.loop

    def run(coro: Coroutine[Any, Any, RolloutResult]) -> RolloutResult:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    return Evaluator(
        ev,
        engine=rollout.engine,
        dataset=dataset,
        rewards=build_reward_pool(spec.reward, spec.sandbox),
        sampling=sampling,
        total_steps=spec.steps,
        run=run,
    )
