"""The agent path and the `Env` path train on the same thing: the same episodes (a scripted
engine answers both with the same token ids and log-probs) taken through `rollout.agent` (the
calculator agent on the real `openai` client, the endpoint, sandbox workers) and through
`rollout.env` (`ToolCalculator`, the same task as an `Env`) give the same training sequences:
token ids, loss mask, behaviour log-probs, rewards, advantages, and the same episode metrics.
Both are also checked against a reconstruction from the engine's raw answers alone (which
requests chain into an episode, which positions the engine sampled, the task's reward rule
written out here, float64 group advantages).

The engine is a script, not a model: a turn's tokens are drawn from a few characters ("?", the
call marker, digits, "x", EOS) by a generator seeded with the request's prompt ids and how many
times that prompt was asked before; a token's log-prob depends only on its context (as a
model's does), so equal contexts give equal log-probs whichever path asks.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
from collections import Counter, defaultdict

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.data.chat_toy import build_chat_toy_tokenizer
from megatron_gspo.data.prompts import PromptDataset, PromptLoader, PromptRecord
from megatron_gspo.engines.types import RolloutResult, RolloutStats, Sample
from megatron_gspo.rewards import RewardPool
from megatron_gspo.rewards.toy import toy_reward
from megatron_gspo.rollout.experience import Rollout, make_multiturn

# agent sandbox workers (openai imported) and an env worker start per run: ~20 s on 2 loaded cores
pytestmark = pytest.mark.slow
TOK = build_chat_toy_tokenizer()
EOS = TOK.eos_token_id
PROMPTS = {"add 37+45=": "82", "add 9+90=": "99"}
GROUP = 8
_ALPHABET = [TOK.convert_tokens_to_ids(c) for c in "?18x"] + [EOS]


def _logprob(context: list[int]) -> float:
    """A token's log-prob as a function of its context (prompt + response so far) only."""
    digest = hashlib.sha256(repr(context).encode()).digest()
    return -0.05 - int.from_bytes(digest[:4], "little") / 2**32


class ScriptedEngine:
    """`agenerate` with scripted answers (module docstring); records every request."""

    def __init__(self) -> None:
        self.asked: Counter = Counter()
        self.calls: list[tuple[list[int], list[int], list[float]]] = []
        self.lock = threading.Lock()

    async def agenerate(self, prompts, sampling, *, n=1, rid_prefix=None):
        await asyncio.sleep(0)  # let the other episodes interleave
        samples = []
        for p in prompts:
            for _ in range(n):
                with self.lock:
                    k = self.asked[tuple(p)]
                    self.asked[tuple(p)] += 1
                rng = random.Random(f"{p}|{k}")
                out: list[int] = []
                while len(out) < sampling.max_new_tokens:
                    out.append(rng.choice(_ALPHABET))
                    if out[-1] in sampling.stop_token_ids:
                        break
                lps = [_logprob(list(p) + out[: i + 1]) for i in range(len(out))]
                with self.lock:
                    self.calls.append((list(p), out, lps))
                stop = bool(out) and out[-1] in sampling.stop_token_ids
                samples.append(
                    Sample(
                        prompt_ids=list(p),
                        response_ids=out,
                        logprobs=lps,
                        logprob_mask=[True] * len(out),
                        finish_reason="stop" if stop else "length",
                        truncated=not stop,
                        weight_version="3",
                        engine_id="script",
                        prompt_index=0,
                        sample_index=len(samples),
                    )
                )
        return RolloutResult(samples=samples, stats=RolloutStats())


def _cfg(*extra: str):
    return load_config(
        None,
        [
            "model.hf_path=/m",
            "data.train_path=/d.jsonl",
            "data.chat_template=true",
            "rollout.max_new_tokens=3",
            "rollout.temperature=1.0",
            f"rl.group_size={GROUP}",
            f"rl.prompts_per_rollout={len(PROMPTS)}",
            "rl.mini_batches_per_rollout=1",
            "reward.kind=toy",
            "reward.num_workers=0",
            # truncated sequences leave the loss: both paths must agree on which are
            "loss.mask_truncated=true",
            *extra,
        ],
    )


def _step(path: str):
    """One rollout step through `path` ("agent" or "env"): (sequences, metrics, engine)."""
    from megatron_gspo.agents.runner import make_agent_rollout

    if path == "agent":
        cfg = _cfg("rollout.agent=megatron_gspo.agents.calculator:solve", "rollout.agent_workers=2")
    else:
        cfg = _cfg(
            "rollout.env=megatron_gspo.envs.calculator:ToolCalculator",
            "rollout.max_turns=2",
            "rollout.max_total_tokens=96",
            'rollout.turn_stop=["?"]',
            "rollout.env_workers=1",
        )
    records = [
        PromptRecord(index=i, prompt=p, answer=a) for i, (p, a) in enumerate(PROMPTS.items())
    ]
    loader = PromptLoader(PromptDataset(records, TOK), len(records), seed=0, shuffle=False)
    engine = ScriptedEngine()
    spec = cfg.rollout_spec()
    make = make_agent_rollout if path == "agent" else make_multiturn
    group_fn, envs = make(spec, engine, TOK)
    ro = Rollout(
        spec, engine, TOK, loader, RewardPool("toy", num_workers=0), group_fn=group_fn, envs=envs
    )
    try:
        seqs, metrics = ro.next_batch()
    finally:
        ro.close()
    return seqs, metrics, engine


def _expected(engine: ScriptedEngine) -> list[tuple]:
    """The training sequences rebuilt from the engine's requests alone: a request that no later
    request continues (whose prompt starts with its prompt + answer) ends an episode; the
    episode's model tokens are the positions its requests sampled (mask 1, their log-probs), the
    rest is context (mask 0, 0.0); the reward is the task's rule on the decoded model turns;
    advantages are float64 group z-scores. Rows: (prompt, response, mask, pi_old, reward,
    advantage, called, model turns)."""
    roots = {tuple(_ids(p)): p for p in PROMPTS}
    ends = Counter(tuple(p + o) for p, o, _ in engine.calls)
    for p, _, _ in engine.calls:  # one instance of its parent is not an episode's end
        parents = [e for e in ends if len(e) < len(p) and tuple(p[: len(e)]) == e]
        if parents:
            ends[max(parents, key=len)] -= 1
    rows, by_prompt = [], defaultdict(list)
    for full, count in ends.items():
        if count <= 0:
            continue
        root = next(r for r in roots if full[: len(r)] == r)
        n = len(root)
        mask, old, turns = [0] * (len(full) - n), [0.0] * (len(full) - n), {}
        for q, o, lps in engine.calls:  # the requests of this episode's chain
            if full[: len(q) + len(o)] == tuple(q + o):
                mask[len(q) - n : len(q) - n + len(o)] = [1] * len(o)
                old[len(q) - n : len(q) - n + len(o)] = lps
                turns[len(q)] = TOK.decode(o, skip_special_tokens=True)
        texts = [turns[k] for k in sorted(turns)]
        prompt = roots[root]
        a, b = prompt.removeprefix("add ").rstrip("=").split("+")
        called = "?" in texts[0]
        assert len(texts) == (2 if called else 1)
        answer_text = str(int(a) + int(b)) + texts[1] if called else texts[0]
        if called and "?" in texts[1]:  # called again instead of answering: no answer
            answer_text = ""
        score = toy_reward("", answer_text, PROMPTS[prompt])
        reward = 0.5 + 0.5 * score if called else 0.5 * score
        for _ in range(count):
            by_prompt[root].append(reward)
            rows.append((root, full[n:], tuple(mask), tuple(old), reward, called, len(texts)))
    out = []
    for root, resp, mask, old, reward, called, turns in rows:
        rs = by_prompt[root]
        mean = sum(rs) / len(rs)
        std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
        adv = 0.0 if max(rs) == min(rs) else (reward - mean) / (std + 1e-6)
        out.append((root, resp, mask, old, reward, adv, called, turns))
    return out


def _ids(prompt: str) -> list[int]:
    """The first call's prompt: the chat template's rendering of the user message."""
    text = TOK.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(TOK(text, add_special_tokens=False)["input_ids"])


def _rows(seqs) -> list[tuple]:
    return sorted(
        (
            tuple(s.prompt_ids),
            tuple(s.response_ids),
            tuple(s.loss_mask),
            tuple(s.old_logp),
            s.reward,
            s.advantage,
        )
        for s in seqs
    )


def _same(got: list[tuple], want: list[tuple]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g[:4] == w[:4]  # ids, loss mask and engine log-probs exactly
        assert g[4:] == pytest.approx(w[4:], rel=0, abs=1e-12)


@pytest.fixture(scope="module")
def both():
    return {path: _step(path) for path in ("agent", "env")}


def test_agent_and_env_paths_train_on_the_same_episodes(both):
    (a_seqs, a_metrics, a_engine), (e_seqs, e_metrics, e_engine) = both["agent"], both["env"]
    # the same requests reached the engine (so the same episodes were sampled) ...
    assert sorted(map(repr, a_engine.calls)) == sorted(map(repr, e_engine.calls))
    want = _expected(a_engine)
    assert len(want) == GROUP * len(PROMPTS)
    calls = sum(w[6] for w in want)
    assert 0 < calls < len(want)  # both kinds of episode are in the batch
    expected_rows = sorted(w[:6] for w in want)
    # ... and both paths hand the loss what the engine's raw answers say
    _same(_rows(a_seqs), expected_rows)
    _same(_rows(e_seqs), expected_rows)
    for m in (a_metrics, e_metrics):
        assert m["env/tool_call_rate"] == pytest.approx(calls / len(want), abs=1e-12)
        assert m["env/turns_mean"] == pytest.approx(sum(w[7] for w in want) / len(want))
        assert m["loss/truncated_masked"] == 0.0  # every episode was ended by its agent / env
    for key in ("reward/mean", "env/env_token_frac", "env/reward_from_env_frac"):
        assert a_metrics[key] == pytest.approx(e_metrics[key], abs=1e-12), key
