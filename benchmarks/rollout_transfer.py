"""The per-step rollout broadcast and the pi_old=recompute gather: pickled Python objects (the
path before issue 20) against tensors (megatron/transfer.py), in one 2-rank gloo job on CPU.

    python benchmarks/rollout_transfer.py     # the 30B recipe's batch: 64 prompts x 8 x 8192
    python benchmarks/rollout_transfer.py --response-len 1024 --prompt-len 256

Shape (examples/recipes/qwen3_30b_a3b_*.yaml): rl/gspo prompts_per_rollout=64 x group_size=8
= 512 sequences; every response at rollout.max_new_tokens=8192 and every prompt at
data.max_prompt_tokens=1024 (the largest batch the recipe can produce).

  broadcast  rank 0's `TrainSequence` list (+ metrics) to rank 1. old:
             `broadcast_object_list` (rank 1 unpickles Python lists); new: `broadcast_sequences`
             (rank 1 holds tensor views of the buffer; values checked equal after timing).
  gather tp2 both ranks hold every token row (TP duplicates, as two TP ranks do); rows end up
             as `{seq_id: log-probs}` on both. old: `all_gather_object` + a loop over rows;
             new: `gather_logprob_rows(duplicate=rank 1)` + `logprobs_by_sequence`.
  gather dp2 each rank holds half of the sequences (data parallel).
bytes = what crosses the wire per receiving rank (pickle payload, or header + tensor buffer);
time = the slowest rank's wall time, best of --repeats; both paths run in the same processes
and their results are checked equal.

Measured (`--repeats 3`, defaults; the shared 2-core machine at a load average of ~24, so the
seconds are inflated, the ratios are what to read):
    what       path          MB        s  old/new s  old/new MB
    broadcast  old         65.7     5.91
    broadcast  new         56.6     3.43        1.7        1.16
    gather tp2 old        100.7   138.95
    gather tp2 new        100.7    22.68        6.1        1.00
    gather dp2 old         50.3    87.25
    gather dp2 new         50.3    22.72        3.8        1.00
("gather" MB: what one rank sends; with TP duplicates left out, rank 1 of tp2 sends nothing.)
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_gspo.algo.sequences import TrainSequence  # noqa: E402
from megatron_gspo.megatron.transfer import (  # noqa: E402
    _to_buffer,
    broadcast_sequences,
    gather_logprob_rows,
    logprobs_by_sequence,
    pack_sequences,
)
from megatron_gspo.testing.harness import spawn_ranks  # noqa: E402

VOCAB = 151_936  # Qwen3


def make_batch(n: int, prompt_len: int, response_len: int, seed: int) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(
            TrainSequence(
                seq_id=i,
                prompt_ids=torch.randint(VOCAB, (prompt_len,), generator=g).tolist(),
                response_ids=torch.randint(VOCAB, (response_len,), generator=g).tolist(),
                old_logp=(-torch.rand(response_len, generator=g, dtype=torch.float64)).tolist(),
                advantage=rng.gauss(0.0, 1.0),
                loss_mask=(torch.rand(response_len, generator=g) > 0.01).int().tolist(),
            )
        )
    return out


def rows_of(seqs: list[TrainSequence]) -> torch.Tensor:
    parts = []
    for s in seqs:
        r = len(s.old_logp)
        sid = torch.full((r,), float(s.seq_id), dtype=torch.float64)
        pos = torch.arange(r, dtype=torch.float64)
        parts.append(torch.stack([sid, pos, torch.tensor(s.old_logp, dtype=torch.float64)], 1))
    return torch.cat(parts)


def _values(seqs: list[TrainSequence]) -> list[dict[str, Any]]:
    """Field values as Python objects (received tensor views via `.tolist()`)."""
    return [
        {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(s).items()}
        for s in seqs
    ]


def old_broadcast(seqs: Any, extra: Any) -> tuple[Any, Any]:
    box = [(seqs, extra)]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def old_gather(rows: torch.Tensor) -> dict[int, torch.Tensor]:
    """The pre-issue-20 `compute_logprobs` tail: every rank's rows pickled to every rank."""
    gathered: list[torch.Tensor] = [None] * torch.distributed.get_world_size()  # type: ignore
    torch.distributed.all_gather_object(gathered, rows)
    table: dict[int, dict[int, float]] = {}
    for part in gathered:
        for sid, pos, lp in part.tolist():
            if sid >= 0:
                table.setdefault(int(sid), {})[int(pos)] = lp
    return {
        sid: torch.tensor([d[i] for i in range(len(d))], dtype=torch.float64)
        for sid, d in sorted(table.items())
    }


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        out = None  # the previous result is freed before the next run
        torch.distributed.barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)
        best = min(best, float(dt))
    return best, out


def _rank(rank: int, world: int, args: dict[str, Any]) -> list[tuple[str, str, float, int]]:
    n = args["prompts"] * args["group"]
    seqs = make_batch(n, args["prompt_len"], args["response_len"], seed=0)
    extra = {"reward/mean": 0.5}
    mine = seqs if rank == 0 else None
    rep = args["repeats"]
    out = []
    t_old, got_old = _timed(lambda: old_broadcast(mine, extra), rep)
    b_old = len(pickle.dumps((seqs, extra)))
    t_new, got_new = _timed(lambda: broadcast_sequences(mine, extra), rep)
    layout, buf = _to_buffer(pack_sequences(seqs))
    b_new = len(pickle.dumps((layout, buf.numel(), extra))) + buf.numel()
    assert _values(got_new[0]) == _values(got_old[0]) == _values(seqs), "sequences changed"
    del got_old, got_new
    out += [("broadcast", "old", t_old, b_old), ("broadcast", "new", t_new, b_new)]
    rows = rows_of(seqs)
    for name, local, dup in (
        ("gather tp2", rows, rank == 1),
        ("gather dp2", rows[rows[:, 0] % world == rank], False),
    ):
        t_old, want = _timed(lambda local=local: old_gather(local), rep)
        b_old = len(pickle.dumps(local))  # one peer's rows, received by each rank
        t_new, got = _timed(
            lambda local=local, dup=dup: logprobs_by_sequence(
                gather_logprob_rows(local, duplicate=dup)
            ),
            rep,
        )
        b_new = 0 if dup else local.numel() * 8 + 8  # rank 1 sends nothing as a duplicate
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
        out += [(name, "old", t_old, b_old), (name, "new", t_new, b_new)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=2)
    args = vars(p.parse_args())
    r0 = spawn_ranks(_rank, 2, args, timeout=3600)[0]
    tokens = args["prompts"] * args["group"] * args["response_len"]
    print(
        f"{args['prompts']} prompts x {args['group']} x (prompt {args['prompt_len']} + response "
        f"{args['response_len']}) = {tokens / 1e6:.2f} M response tokens, 2 gloo ranks on CPU"
    )
    print(f"{'what':<11}{'path':<6}{'MB':>10}{'s':>9}{'old/new s':>11}{'old/new MB':>12}")
    by = {(w, k): (t, b) for w, k, t, b in r0}
    for what in dict.fromkeys(w for w, _, _, _ in r0):
        (t_old, b_old), (t_new, b_new) = by[(what, "old")], by[(what, "new")]
        print(f"{what:<11}{'old':<6}{b_old / 1e6:>10.1f}{t_old:>9.2f}")
        ratio_b = f"{b_old / b_new:.2f}" if b_new else "inf"
        print(f"{what:<11}{'new':<6}{b_new / 1e6:>10.1f}{t_new:>9.2f}{t_old / t_new:>11.1f}"
              f"{ratio_b:>12}")  # fmt: skip


if __name__ == "__main__":
    main()
