"""Multi-turn rollouts (`rollout.env`): exact masks, the engine sees exactly the trainer's ids,
env code runs in worker processes, env failures cost an episode and are loud.

A fake engine (deterministic in its seed and prompt) records every `/generate` input; the
expected response ids, masks and log-probs are rebuilt independently from those records and
the test env's rules (tests/rollout/env_fixtures.py), not from the code under test.
"""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from megatron_gspo.config import ConfigError, load_config
from megatron_gspo.data.prompts import PromptDataset, PromptLoader, PromptRecord
from megatron_gspo.data.toy import build_toy_tokenizer
from megatron_gspo.engines.types import RolloutResult, RolloutStats, Sample, SamplingParams
from megatron_gspo.rewards import RewardPool
from megatron_gspo.rollout.experience import Rollout, make_multiturn

FIX = __name__.rpartition(".")[0] + ".env_fixtures"
TOK = build_toy_tokenizer()


class FakeEngine:
    """`agenerate` for one prompt: 1-3 printable tokens chosen by (seed, prompt length), then EOS;
    cut at `max_new_tokens` and at the first stop id. Records (prompt, sampling, output)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], SamplingParams, list[int]]] = []

    async def agenerate(self, prompts, sampling, *, n=1):
        (p,) = prompts
        await asyncio.sleep(0)  # let other episodes interleave
        key = (sampling.seed or 0) + len(p)
        out = [4 + (key * 7 + i * 13) % 90 for i in range(1 + key % 3)] + [TOK.eos_token_id]
        out = out[: sampling.max_new_tokens]
        for i, t in enumerate(out):
            if t in sampling.stop_token_ids:
                out = out[: i + 1]
                break
        self.calls.append((list(p), sampling, out))
        lps = [-0.001 * (key % 97 + i + 1) for i in range(len(out))]
        sample = Sample(
            prompt_ids=list(p),
            response_ids=out,
            logprobs=lps,
            logprob_mask=[True] * len(out),
            finish_reason="stop" if out and out[-1] == TOK.eos_token_id else "length",
            truncated=False,
            weight_version="v7",
            engine_id="fake",
            prompt_index=0,
            sample_index=0,
        )
        return RolloutResult(samples=[sample], stats=RolloutStats())


def _cfg(*extra: str):
    return load_config(
        None,
        [
            "model.hf_path=/m",
            "data.train_path=/d.jsonl",
            f"rollout.env={FIX}:ToolEnv",
            "rollout.max_turns=3",
            "rollout.max_new_tokens=4",
            "rollout.max_total_tokens=64",
            "rollout.env_workers=1",
            "rl.group_size=3",
            "rl.prompts_per_rollout=2",
            "rl.mini_batches_per_rollout=1",
            "reward.kind=toy",
            "reward.num_workers=0",
            *extra,
        ],
    )


def _rollout(cfg, answers=("12", "7")) -> tuple[Rollout, FakeEngine]:
    records = [PromptRecord(index=i, prompt=f"add {i}+5=", answer=a) for i, a in enumerate(answers)]
    dataset = PromptDataset(records, TOK, chat_template=False)
    loader = PromptLoader(dataset, cfg.rl.prompts_per_rollout, seed=0, shuffle=False)
    engine = FakeEngine()
    group_fn, envs = make_multiturn(cfg.rollout_spec(), engine, TOK)
    rewards = RewardPool("toy", num_workers=0)
    ro = Rollout(cfg.rollout_spec(), engine, TOK, loader, rewards, group_fn=group_fn, envs=envs)
    return ro, engine


def _ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def expected_episode(full: list[int], n_prompt: int, record_prompt: str, calls) -> tuple:
    """Response ids, loss mask and pi_old of one ToolEnv episode, rebuilt from the engine's
    recorded calls: the call whose input is the current context (and whose output the sequence
    continues with: samples of a group share their first input), its output (mask 1, its
    log-probs), then ToolEnv's observation (mask 0, log-prob 0)."""
    prompt = full[:n_prompt]
    resp = _ids(f"[{record_prompt}]")
    mask, old = [0] * len(resp), [0.0] * len(resp)
    for turn in range(1, 4):
        ctx = prompt + resp
        (p, sampling, out), *_ = [
            c for c in calls if c[0] == ctx and full[len(ctx) : len(ctx) + len(c[2])] == c[2]
        ]
        key = (sampling.seed or 0) + len(p)
        resp += out
        mask += [1] * len(out)
        old += [-0.001 * (key % 97 + i + 1) for i in range(len(out))]
        if turn < 3:
            obs = _ids(f"<{turn}:{len(TOK.decode(out, skip_special_tokens=True))}>")
            resp, mask, old = resp + obs, mask + [0] * len(obs), old + [0.0] * len(obs)
    return resp, mask, old


def check_sequence(seq, record_prompt: str, calls) -> None:
    full = list(seq.prompt_ids) + list(seq.response_ids)
    resp, mask, old = expected_episode(full, len(seq.prompt_ids), record_prompt, calls)
    assert list(seq.response_ids) == resp
    assert list(seq.loss_mask) == mask
    assert list(seq.old_logp) == pytest.approx(old, abs=0)


def test_masks_are_exact_and_the_engine_sees_the_trainers_ids(capsys):
    cfg = _cfg()
    ro, engine = _rollout(cfg)
    try:
        seqs, metrics = ro.next_batch()
    finally:
        ro.close()
    assert len(seqs) == 6
    prompts = {tuple(TOK(f"add {i}+5=")["input_ids"]): f"add {i}+5=" for i in range(2)}
    for seq in seqs:
        check_sequence(seq, prompts[tuple(seq.prompt_ids)], engine.calls)
        # the trainer's ids: every engine input is a prefix of them, one per model turn
        full = list(seq.prompt_ids) + list(seq.response_ids)
        mine = [c for c in engine.calls if full[: len(c[0])] == c[0] and c[0] != full]
        assert len({len(c[0]) for c in mine}) == 3
        assert seq.advantage == pytest.approx(0.0)  # ToolEnv's reward 0.75 for everyone
    # a planted off-by-one (the mask shifted by one token) fails the check
    bad = seqs[0]
    bad.loss_mask = [0] + list(bad.loss_mask[:-1])
    with pytest.raises(AssertionError):
        check_sequence(bad, prompts[tuple(bad.prompt_ids)], engine.calls)
    assert metrics["reward/mean"] == pytest.approx(0.75)  # the env's reward, not toy_reward
    assert metrics["env/turns_mean"] == 3.0 and metrics["env/tool_call_rate"] == 1.0
    assert metrics["env/failures"] == 0.0 and 0 < metrics["env/env_token_frac"] < 1
    assert FIX not in sys.modules  # env code never imported in the trainer
    assert "[env]" not in capsys.readouterr().err


def test_token_cap_turn_stop_and_reward_fallback():
    """rollout.max_total_tokens caps the episode (model + env tokens; budget passed to the
    engine); rollout.turn_stop ids reach the engine; an env that gives no reward is scored by
    the reward function on the decoded response."""
    stop = "$"
    cfg = _cfg(
        f"rollout.env={FIX}:NoRewardEnv",
        "rollout.max_total_tokens=6",
        f"rollout.turn_stop=['{stop}']",
    )
    ro, engine = _rollout(cfg)
    try:
        seqs, metrics = ro.next_batch()
    finally:
        ro.close()
    stop_id = _ids(stop)[0]
    assert all(stop_id in c[1].stop_token_ids for c in engine.calls)
    assert all(len(s.response_ids) <= 6 for s in seqs)
    assert any(len(s.response_ids) == 6 for s in seqs)
    assert all(c[1].max_new_tokens <= 4 for c in engine.calls)
    assert any(c[1].max_new_tokens < 4 for c in engine.calls)  # the cap shrank a turn's budget
    from megatron_gspo.rewards.toy import toy_reward

    texts = [TOK.decode(s.response_ids, skip_special_tokens=True) for s in seqs]
    assert metrics["reward/mean"] == pytest.approx(
        sum(
            toy_reward("", t, "12" if s.prompt_ids == TOK("add 0+5=")["input_ids"] else "7")
            for s, t in zip(seqs, texts)
        )
        / len(seqs)
    )
    # rollout.max_turns ends an episode the env never ends
    cfg = _cfg(f"rollout.env={FIX}:NoRewardEnv", "rollout.max_turns=2")
    ro, engine = _rollout(cfg)
    try:
        seqs, metrics = ro.next_batch()
    finally:
        ro.close()
    assert metrics["env/turns_mean"] == 2.0 and len(engine.calls) == 2 * len(seqs)
    from megatron_gspo.run.preflight import _check_module

    with pytest.raises(ConfigError, match="rollout.env='no_such_mod_xyz:E': cannot import"):
        _check_module("no_such_mod_xyz:E", "rollout.env")
    with pytest.raises(ConfigError, match="rollout.turn_stop entry 'ab' is 2 tokens"):
        make_multiturn(_cfg("rollout.turn_stop=[ab]").rollout_spec(), FakeEngine(), TOK)
    with pytest.raises(ConfigError, match="set rollout.env"):
        load_config(None, ["model.hf_path=/m", "data.train_path=/d", "rollout.turn_stop=[x]"])
    with pytest.raises(ConfigError, match="cannot hold one episode"):
        _cfg("rollout.max_total_tokens=9000")


def test_env_runs_in_a_worker_process():
    cfg = _cfg(f"rollout.env={FIX}:PidEnv", "rollout.env_workers=2")
    ro, _ = _rollout(cfg)
    record = ro.loader.dataset[0]
    try:
        samples = asyncio.run(
            ro.group_fn(record, ro.loader.dataset.encode(record), SamplingParams(seed=1), 4, 0)
        )
        pids = set(ro.envs.worker_pids)
    finally:
        ro.close()
    seen = {int(s.env_reward) for s in samples}
    assert seen <= pids and os.getpid() not in pids and len(pids) == 2
    assert len(seen) == 2  # episodes spread over both workers
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        make_multiturn(_cfg(f"rollout.env={FIX}:Nope").rollout_spec(), FakeEngine(), TOK)


def test_env_failures_are_left_out_counted_and_printed(capsys):
    """An episode whose environment failed (reset or step raised, a malformed step answer) is
    never trained (no made-up reward 0): it is left out of its group and counted; a group with
    every episode failed gives its prompt back and another prompt takes its place."""
    cfg = _cfg(f"rollout.env={FIX}:BuggyEnv", "rl.prompts_per_rollout=2", "rl.group_size=2")
    ro, _ = _rollout(cfg, answers=("raise", "bad", "reset-bug", "ok"))
    try:
        seqs, metrics = ro.next_batch()
    finally:
        ro.close()
    prompt_of = {tuple(ro.loader.dataset.encode(r)): r.answer for r in ro.loader.dataset}
    answers = [prompt_of[tuple(s.prompt_ids)] for s in seqs]
    assert answers == ["ok"] * 4  # two "ok" groups; no failed episode is trained
    assert metrics["reward/mean"] == 1.0
    assert metrics["rollout/groups_empty"] == 6 and metrics["rollout/groups_dropped"] == 0
    assert metrics["rollout/samples_failed"] == 12 and metrics["env/failures"] >= 12.0
    err = capsys.readouterr().err
    assert "ValueError: env bug in step" in err and "KeyError" in err and "TypeError" in err


def test_env_timeout_replaces_the_worker():
    cfg = _cfg(
        f"rollout.env={FIX}:BuggyEnv",
        "rollout.env_timeout_s=2",
        "rl.prompts_per_rollout=1",
        "rl.group_size=2",
    )
    ro, _ = _rollout(cfg, answers=("hang", "ok"))
    try:
        before = ro.envs.worker_pids
        seqs, metrics = ro.next_batch()
        after = ro.envs.worker_pids
    finally:
        ro.close()
    assert metrics["env/timeouts"] >= 1 and metrics["rollout/samples_failed"] == 2
    assert metrics["reward/mean"] == 1.0  # the timed-out episodes are not trained as reward 0
    assert before != after and len(seqs) == 2


def test_a_real_engine_scores_exactly_the_trainers_ids(client_a, ckpt_a):
    """The embedded engine (SGLang's HTTP app, a HF model) over a 3-turn ToolEnv episode: every
    engine turn saw the whole context (its prompt length), and a full forward pass of the
    reference model over prompt + response ids (the trainer's sequence) reproduces the engine's
    log-probs on every model token: the engine's context was those exact ids. Env tokens carry
    log-prob 0 and mask False."""
    from megatron_gspo.envs.pool import EnvPool
    from megatron_gspo.rollout.multiturn import MultiTurn, ObservationCodec
    from tests.engines.helpers import hf_model, rescore

    record = PromptRecord(index=0, prompt="add 1+5=", answer="6")
    prompt = TOK(record.prompt)["input_ids"]
    with EnvPool(f"{FIX}:ToolEnv", num_workers=1, timeout_s=30) as envs:
        codec = ObservationCodec(TOK, chat_template=False)
        multi = MultiTurn(client_a, TOK, envs, codec, max_turns=3, max_total_tokens=40)
        sampling = SamplingParams(max_new_tokens=4, seed=3)
        samples = asyncio.run(multi.group_fn(record, prompt, sampling, 2, 0))
    ref = hf_model(ckpt_a)
    assert len(samples) == 2
    for s in samples:
        model_turns = [t for t in s.meta["turns"] if t["kind"] == "model"]
        assert len(model_turns) == 3
        assert [t["prompt_tokens"] for t in model_turns] == [
            len(prompt) + t["start"] for t in model_turns
        ]
        trainer = rescore(ref, s.prompt_ids, s.response_ids)
        on_model = {i for t in model_turns for i in range(t["start"], t["end"])}
        for i, (e, t, m) in enumerate(zip(s.logprobs, trainer, s.logprob_mask, strict=True)):
            if i in on_model:
                assert m and abs(e - t) < 2e-5, (i, e, t)
            else:
                assert not m and e == 0.0


CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def test_chat_template_observations_are_template_deltas():
    """With a chat template, prompt + model turns + observation deltas, built incrementally, are
    exactly the template's tokenisation of the whole conversation (a turn stopped without EOS
    gets the template's closing from the env side; one that ended with EOS does not repeat
    it)."""
    from megatron_gspo.rollout.multiturn import ObservationCodec

    tok = build_toy_tokenizer()
    tok.chat_template = CHAT
    codec = ObservationCodec(tok, chat_template=True)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    msgs = [{"role": "user", "content": "add 1+5="}]
    prompt = ids(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    turn1 = ids("?")  # stopped by rollout.turn_stop: no EOS
    turn2 = ids("6") + [tok.eos_token_id]  # ended with EOS
    built = prompt + turn1 + codec.encode("6", turn1) + turn2 + codec.encode("ok", turn2)
    conv = [
        *msgs,
        {"role": "assistant", "content": "?"},
        {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "6"},
        {"role": "tool", "content": "ok"},
    ]
    whole = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert built == ids(whole)
    assert ObservationCodec(tok, chat_template=False).encode("6", turn1) == ids("6")


def test_reward_function_errors_are_printed_once_per_step(capsys):
    """A reward function that raises is loud: the step prints the count and the first error
    texts to stderr (was: reward 0 and a count in metrics.jsonl only)."""
    cfg = _cfg(f"rollout.env={FIX}:NoRewardEnv")
    ro, _ = _rollout(cfg)
    ro.rewards = RewardPool(f"{FIX}:raising_reward", num_workers=1, timeout_s=30)
    try:
        _, metrics = ro.next_batch()
    finally:
        ro.close()
    err = capsys.readouterr().err
    assert metrics["reward/failures"] == 6.0
    assert err.count("[reward] 6 of 6 calls failed") == 1 and "RuntimeError: reward bug 42" in err


def test_episodes_spread_over_engines_and_stick_to_one(engine_a, engine_b):
    """With two engines, a group's episodes use both, and each episode's turns stay on one
    engine (its prefix cache). One shared client would send every turn to the first engine: a
    fresh single-prompt `agenerate` call sees every engine idle."""
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.connect import per_engine_clients
    from megatron_gspo.envs.pool import EnvPool
    from megatron_gspo.rollout.multiturn import MultiTurn, ObservationCodec

    client = SGLangClient(ClientConfig(engine_urls=[engine_a.url, engine_b.url]))
    record = PromptRecord(index=0, prompt="add 1+5=", answer="6")
    prompt = TOK(record.prompt)["input_ids"]
    sampling = SamplingParams(max_new_tokens=3, seed=5)

    def engines_per_episode(rotate: bool) -> list[set[str]]:
        with EnvPool(f"{FIX}:ToolEnv", num_workers=1, timeout_s=30) as envs:
            codec = ObservationCodec(TOK, chat_template=False)
            multi = MultiTurn(
                client,
                TOK,
                envs,
                codec,
                max_turns=3,
                max_total_tokens=40,
                engines=per_engine_clients(client) if rotate else (),
            )
            samples = asyncio.run(multi.group_fn(record, prompt, sampling, 4, 0))
        return [{t["engine"] for t in s.meta["turns"] if t["kind"] == "model"} for s in samples]

    rotated = engines_per_episode(True)
    assert all(len(e) == 1 for e in rotated)
    assert set().union(*rotated) == {engine_a.url, engine_b.url}
    # one view of dead / rejoining engines (the weight sync's): no turn to an engine it dropped
    assert all(c.pool is client.pool for c in per_engine_clients(client))
    client.close()
