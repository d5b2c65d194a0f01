"""Rank program for the GSPO parallel-invariance tests (spawned by test_policy_layouts.py).

Each case: build the tiny MoE at a layout, make a deterministic batch of packed sequences of
unequal lengths, recompute current log-probs, set pi_old = current - a per-sequence offset
(some sequences inside the GSPO clip band, some outside, on both sides) - zero-mean token noise,
then one train step with the policy loss. Returns the loss, reduced metrics and the weight
delta of an Adam step with lr = 100 eps, eps >> |g| (= -100 x the gradient) as full HF tensors.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_gspo.algo import PolicyLossConfig
from megatron_gspo.config import OptimConfig
from megatron_gspo.megatron import step as mstep
from megatron_gspo.megatron.model import (
    Layout,
    build_model,
    build_optimizer,
    ddp_config,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.megatron.packing import TrainSequence
from megatron_gspo.testing.weights import hf_state

NUM_SEQS, MAX_TOKENS = 10, 24


def make_sequences(vocab: int, seed: int = 0) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(NUM_SEQS):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = int(torch.randint(1, 13, (1,), generator=g))
        ids = torch.randint(3, vocab, (p + r,), generator=g).tolist()
        out.append(
            dict(
                seq_id=i,
                prompt_ids=ids[:p],
                response_ids=ids[p:],
                # offsets in units of the GSPO band: |offset| < 3e-4 stays inside, larger clips
                offset=float(torch.empty(1).uniform_(-9e-4, 9e-4, generator=g)),
                noise=(torch.randn(r, generator=g) * 1e-3).tolist(),
                advantage=float(torch.randn(1, generator=g)),
            )
        )
    return out


def _train_sequences(
    raw: list[dict],
    current: dict[int, torch.Tensor],
    kind: str,
    length_weighted: bool,
    with_ref: bool = False,
) -> list[TrainSequence]:
    mean_len = sum(len(s["response_ids"]) for s in raw) / len(raw)
    seqs = []
    for s in raw:
        cur = current[s["seq_id"]]
        noise = torch.tensor(s["noise"], dtype=torch.float64)
        noise = noise - noise.mean()
        old = (cur - s["offset"] - noise).tolist()
        adv: float | list[float] = s["advantage"]
        if kind == "gspo_token" or length_weighted:
            w = len(s["response_ids"]) / mean_len if length_weighted else 1.0
            adv = [s["advantage"] * w] * len(s["response_ids"])
        seqs.append(
            TrainSequence(
                seq_id=s["seq_id"],
                prompt_ids=s["prompt_ids"],
                response_ids=s["response_ids"],
                old_logp=old,
                advantage=adv,
                # pi_ref: the current policy moved by a deterministic per-token offset
                ref_logp=(cur + 50 * noise.flip(0)).tolist() if with_ref else None,
            )
        )
    return seqs


def _micro_batch_mean_step(model, optimizer, mbs, cfg, dp, n_global):  # noqa: ANN001, ANN202
    """A planted bug: each micro-batch normalised by its own size (Megatron-style averaging)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(it, m):  # noqa: ANN001, ANN202
        mb = next(it)
        # Megatron divides by the global sequence count N; this bug weights each micro-batch
        # as if it held N / (micro-batches * dp) sequences.
        share = n_global / (mb.num_seqs * len(mbs) * dp)
        loss_fn = partial(mstep._policy_loss, mb, cfg)

        def scaled(logits):  # noqa: ANN001, ANN202
            loss, count, reduced = loss_fn(logits)
            return loss * share, count, reduced

        return mstep._forward(m, mb, cfg), scaled

    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=mstep._iterators(model, mbs),
        model=model,
        num_microbatches=len(mbs),
        seq_length=64,
        micro_batch_size=1,
        forward_only=False,
    )
    optimizer.step()


def run_case(bridge: Any, case: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    layout = Layout(**case["layout"])
    init_megatron(layout)
    provider = make_provider(bridge, layout)
    distopt = case.get("distopt", False)
    model = build_model(provider, ddp_config=ddp_config(distopt), load_from=bridge)
    opt = build_optimizer(
        model, OptimConfig(lr=1e6, adam_eps=1e4, clip_grad=0.0, use_distributed_optimizer=distopt)
    )
    vocab = bridge.hf_pretrained.config.vocab_size
    raw = make_sequences(vocab)
    dp = ps.get_data_parallel_world_size()

    def plan(seqs: list[TrainSequence]) -> list:
        return mstep.plan_for_this_rank(seqs, layout, MAX_TOKENS)

    kind = case.get("kind", "gspo")
    if case.get("plant") == "length_weighted":  # GSPO with A_i scaled by |y_i| / mean |y|
        kind = "gspo_token"
    placeholder = _train_sequences(
        raw, {s["seq_id"]: torch.zeros(len(s["response_ids"])) for s in raw}, "gspo", False
    )
    fused = case.get("fused", True)  # the fused LM head, or the output layer's logits
    calls: list[int] = []
    head = mstep._fused_head
    # Count the fused head's calls (on the last stage): the comparisons must be of that path.
    mstep._fused_head = lambda *a, **k: calls.append(1) or head(*a, **k)  # type: ignore
    current = mstep.compute_logprobs(model, plan(placeholder), fused_lm_head=fused)
    loss_kw = case.get("loss", {})
    seqs = _train_sequences(
        raw, current, kind, case.get("plant") == "length_weighted", "kl_coef" in loss_kw
    )
    mbs = plan(seqs)
    cfg = mstep.StepConfig(loss=PolicyLossConfig(kind=kind, **loss_kw), fused_lm_head=fused)
    if case.get("plant") == "micro_batch_mean":
        _micro_batch_mean_step(model, opt, mbs, cfg, dp, len(seqs))
        metrics: dict[str, float] = {}
    else:
        metrics = mstep.train_step(model, opt, mbs, cfg)
    mstep._fused_head = head  # type: ignore
    return {
        "fused_calls": len(calls),
        "metrics": metrics,
        "current": current,
        "num_micro_batches": len(mbs),
        "weights": hf_state(bridge, model),
    }


def main(rank: int, world: int, hf_dir: str, cases: list[dict[str, Any]]) -> dict[str, Any]:
    quiet_megatron()
    bridges = {hf_dir: load_bridge(hf_dir)}
    out = {}
    for case in cases:
        path = case.get("hf_dir", hf_dir)  # e.g. a tied-embeddings variant of the model
        if path not in bridges:
            bridges[path] = load_bridge(path)
        out[case["name"]] = run_case(bridges[path], case)
        if rank != 0:
            out[case["name"]].pop("weights")
    return out
