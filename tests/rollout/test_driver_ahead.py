"""Rollouts k steps ahead (`RolloutDriver(lookahead=k)`, `rollout.async_rollout` with
`rollout.max_staleness: k`) on the deterministic fake engine: the engines generate the next k
batches while the trainer trains, responses continue across weight pushes with per-token
versions, no trained token is more than k versions old, the staleness histogram adds up, and
the loss of such a batch equals a float64 reference whose pi_old is, token by token, the
log-prob of the weight version that sampled it (read from the engine's own log)."""

from __future__ import annotations

import time
import types

import pytest
import torch

from megatron_gspo.rollout.driver import RolloutDriver
from tests.algo.reference import RefSeq, reference_loss
from tests.engines.fake_engine import FakeEngine, check_sample_against_engine, logprob
from tests.rollout.test_scheduler import P, _ids, make

K = 3


def _train_steps(driver: RolloutDriver, engine: FakeEngine, steps: int, *, wait_ahead: bool):
    """`steps` trainer steps; "training" lasts until every queued fill is done (or, without
    wait_ahead, until the engine made a few tokens), then a weight push. Returns (batch,
    metrics) pairs."""
    out = []
    driver.resume(engine.version)
    for _ in range(steps):
        batch, metrics = driver.next_batch()
        assert batch.target_version == driver.version
        out.append((batch, metrics))
        deadline = time.monotonic() + 60  # a bound for a hung fill, not a timing check
        start = engine.tokens
        while not all(f.done() for _, f in driver._ahead) and time.monotonic() < deadline:
            if not wait_ahead and engine.tokens >= start + 4:
                break
            time.sleep(0.002)
        driver.pause()
        engine.version += 1
        driver.resume(engine.version)
    return out


def test_k_ahead_batches_are_generated_during_training_within_the_staleness_bound():
    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=6, oversample=1.5, partial_tokens=2, max_staleness=K)
    driver = RolloutDriver(sched, lookahead=K)
    try:
        steps = _train_steps(driver, engine, 6, wait_ahead=True)
    finally:
        driver.close()
    worst, seen = 0, []
    for batch, _ in steps:
        per_sample = []
        for g in batch.groups:
            for s in g.samples:
                check_sample_against_engine(engine, s)  # ids, log-probs, versions exact
                age = batch.target_version - min(s.token_versions)
                assert 0 <= age <= K
                per_sample.append(age)
        worst = max(worst, *per_sample)
        seen += _ids(batch.groups)
        m = batch.metrics()
        hist = [m[f"rollout/sample_staleness_{k}"] for k in range(K + 1)]
        expect = [per_sample.count(k) / len(per_sample) for k in range(K + 1)]
        assert hist == pytest.approx(expect)
        assert sum(hist) == pytest.approx(1.0)
    # the trainer waited for k batches ahead: the last of them was made k versions early
    assert worst == K
    assert len(seen) == len(set(seen)) == 6 * P  # nothing lost or trained twice
    later = [m for _, m in steps[1:]]
    assert all(m["rollout/engine_busy_frac"] > 0 for m in later)
    assert max(m["rollout/batches_ready"] for m in later) == K


def test_synchronous_driver_generates_nothing_while_the_trainer_trains():
    engine = FakeEngine(stop_token=None)
    driver = RolloutDriver(make(engine, max_new=4), lookahead=0)
    try:
        steps = _train_steps(driver, engine, 3, wait_ahead=False)
    finally:
        driver.close()
    assert all(m["rollout/engine_busy_frac"] == 0.0 for _, m in steps[1:])
    assert all(b.metrics()["rollout/sample_staleness_0"] == 1.0 for b, _ in steps)


@pytest.mark.parametrize("kind", ["gspo", "grpo"])
def test_loss_of_a_k_ahead_batch_uses_each_tokens_behaviour_logprob(kind):
    """Batch -> `Rollout._sequence` -> packed micro-batch -> the loss, against the float64
    reference of tests/algo/reference.py with pi_old[t] = the engine's log-prob of token t
    under the version the engine logged for it (several versions within one response)."""
    from megatron_gspo.algo.losses import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs
    from megatron_gspo.megatron.packing import pack
    from megatron_gspo.rollout.experience import Rollout

    engine = FakeEngine(stop_token=None)
    sched = make(engine, max_new=6, oversample=1.5, partial_tokens=2, max_staleness=K)
    driver = RolloutDriver(sched, lookahead=K)
    try:
        steps = _train_steps(driver, engine, 4, wait_ahead=False)
    finally:
        driver.close()
    batch = max((b for b, _ in steps), key=lambda b: sum(
        len(set(s.token_versions)) > 1 for g in b.groups for s in g.samples
    ))
    samples = [s for g in batch.groups for s in g.samples]
    assert any(len(set(s.token_versions)) > 1 for s in samples)
    gen = torch.Generator().manual_seed(1)
    advs = torch.randn(len(samples), generator=gen, dtype=torch.float64).tolist()
    owner = types.SimpleNamespace(next_seq_id=0)
    seqs = [Rollout._sequence(owner, s, a, 0.0, i) for i, (s, a) in enumerate(zip(samples, advs))]
    mb = pack(seqs, multiple=1)
    pos = mb.token_pos >= 0
    deltas = [torch.randn(len(s.response_ids), generator=gen, dtype=torch.float64) * 0.1
              for s in samples]  # fmt: skip
    ref_seqs = []
    for s, a, d in zip(samples, advs, deltas):
        old = []
        for t, tok in enumerate(s.response_ids):
            ctx = s.prompt_ids + s.response_ids[:t]
            # float32, as TrainSequence packs it: a ratio at a clip edge is then clipped (or
            # not) alike on both sides, whatever batch the threads made (was: flaky at 1e-6)
            lp = logprob(ctx, tok, engine.log[(tuple(ctx), tok)])
            old.append(float(torch.tensor(lp, dtype=torch.float32)))
        new = (torch.tensor(old, dtype=torch.float64) + d).requires_grad_(True)
        ref_seqs.append(RefSeq(logp=new, old=old, mask=list(s.logprob_mask), adv=a))
    # the packed policy log-probs: the reference's values at the same (sequence, token)
    leaf = torch.zeros(mb.old_logp.shape[0], dtype=torch.float64)
    for t in torch.nonzero(pos).flatten().tolist():
        r = ref_seqs[int(mb.seq_index[t])]
        leaf[t] = r.logp[int(mb.token_pos[t])].detach()
    leaf.requires_grad_(True)
    per_token = kind == "grpo"
    adv_t = torch.tensor(advs, dtype=torch.float64)
    inputs = PolicyLossInputs(
        logp=leaf,
        old_logp=mb.old_logp.double(),
        advantages=adv_t[mb.seq_index.clamp(min=0)] if per_token else adv_t,
        seq_index=mb.seq_index,
        mask=mb.mask,
        num_seqs=len(samples),
        advantages_per_token=per_token,
    )
    cfg = PolicyLossConfig(kind=kind, eps_low=0.02, eps_high=0.03)  # some terms clip
    loss, _ = POLICY_LOSSES[kind](inputs, cfg, denominator=float(len(samples)))
    ref = reference_loss(
        ref_seqs, kind=kind, eps_low=0.02, eps_high=0.03, denominator=float(len(samples))
    )
    assert ref.clipped_low + ref.clipped_high > 0 and ref.unclipped > 0
    # pi_old float32 on both sides: 1e-6; a token's log-prob under a neighbouring version
    # differs by 1e-3 (tests/engines/fake_engine.py), which moves the loss by far more
    assert loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    # one behaviour version per response (its last chunk's) is a different, wrong loss
    last = [
        RefSeq(
            logp=r.logp.detach(),
            old=[logprob(s.prompt_ids + s.response_ids[:t], tok, int(s.weight_version))
                 for t, tok in enumerate(s.response_ids)],  # fmt: skip
            mask=r.mask,
            adv=r.adv,
        )
        for s, r in zip(samples, ref_seqs)
    ]
    wrong = reference_loss(last, kind=kind, eps_low=0.02, eps_high=0.03, denominator=len(samples))
    # some packed pi_old differs from its response's last version by the fake engine's
    # per-version step (1e-3), and the loss moves far beyond the 1e-6 above (how far depends on
    # how many tokens the threads' batch carried across versions: 7e-5 relative at least seen)
    packed_vs_last = [
        abs(float(mb.old_logp[t]) - last[int(mb.seq_index[t])].old[int(mb.token_pos[t])])
        for t in torch.nonzero(pos).flatten().tolist()
    ]
    assert max(packed_vs_last) > 5e-4
    assert loss.item() != pytest.approx(wrong.loss.item(), rel=1e-5)
    loss.backward()
    ref.loss.backward()
    for t in torch.nonzero(pos).flatten().tolist():
        g = ref_seqs[int(mb.seq_index[t])].logp.grad  # None: a clipped sequence (constant)
        expect = 0.0 if g is None else g[int(mb.token_pos[t])].item()
        assert leaf.grad[t].item() == pytest.approx(expect, rel=1e-6, abs=1e-12)
