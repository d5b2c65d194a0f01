"""The per-step data every rank needs, moved as tensors instead of pickled Python objects.

* `broadcast_sequences`: rank 0's rollout (a list of `TrainSequence`) to every rank. The
  sequences are packed into flat arrays (token ids, log-probs, masks, advantages) plus per
  sequence lengths, laid end to end in ONE uint8 buffer and sent with one
  `torch.distributed.broadcast`; only a small header (dtypes, element counts, which optional
  fields are present) and the step's metrics go through `broadcast_object_list`. Receivers
  get `TrainSequence`s whose per-token fields are tensor views of the received buffer (no
  Python object per token; `packing.pack` reads them as it reads lists) holding the sender's
  values bit for bit: ids travel in the narrowest integer dtype that holds them, log-probs
  and advantages as float64.
* `gather_logprob_rows` + `logprobs_by_sequence`: the pi_old=recompute gather. Each rank's
  `[N, 3]` float64 rows (sequence id, response position, log-prob) are all-gathered as tensors
  (sizes first, then one padded `all_gather`); ranks that hold duplicates (tensor-parallel
  ranks other than 0 compute the same rows as TP rank 0) contribute no rows. The rows are
  then sorted and split per sequence without a Python loop over tokens.

Both run on host tensors: on GPU the default group is `cpu:gloo,cuda:nccl` (dist.py), so the
waiting ranks wait in gloo, as with the object collectives they replace.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from megatron_gspo.algo.sequences import TrainSequence
from megatron_gspo.dist import device as job_device

__all__ = [
    "broadcast_sequences",
    "gather_logprob_rows",
    "logprobs_by_sequence",
    "pack_sequences",
    "unpack_sequences",
]

_INT_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)
_OPTIONAL = ("loss_mask", "rollout_logp", "ref_logp")
_SCALARS = ("reward", "group")  # optional per-sequence numbers


def _ints(values: array) -> Tensor:
    """`values` (an int64 array) in the narrowest integer dtype that holds them exactly."""
    t = torch.frombuffer(values, dtype=torch.int64) if values else torch.zeros(0)
    if t.numel() == 0:
        return t.to(torch.uint8)
    lo, hi = int(t.min()), int(t.max())
    for dtype in _INT_DTYPES:
        info = torch.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return t.to(dtype)
    return t


def _floats(values: array) -> Tensor:
    """`values` (a double array) as float64, what a Python float is: exact."""
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    return torch.frombuffer(values, dtype=torch.float64)


def _flat(seqs: Sequence[TrainSequence], field: str, code: str = "q") -> array:
    """One field of every sequence end to end (sequences without it are skipped), converted
    in C by `array.extend`, several times faster than `torch.tensor(list)`."""
    out = array(code)
    for s in seqs:
        if (x := getattr(s, field)) is not None:
            out.extend(x)
    return out


def pack_sequences(seqs: Sequence[TrainSequence]) -> dict[str, Tensor]:
    """`seqs` as named host tensors (S sequences, R response tokens in all, P prompt tokens):

    seq_id [S], prompt_len [S], response_len [S], prompt_ids [P], response_ids [R],
    old_logp [R] float64, advantage [S] or [R] float64 (`adv_per_token` [1] says which),
    per optional field f in (loss_mask, rollout_logp, ref_logp): has_f [S] (0/1) and f [sum
    of the response lengths of the sequences that have it]; reward [S] float64 and group [S]
    with has_reward / has_group [S].
    """
    per_token = bool(seqs) and not isinstance(seqs[0].advantage, float | int)
    out = {
        "seq_id": _ints(array("q", [s.seq_id for s in seqs])),
        "prompt_len": _ints(array("q", [len(s.prompt_ids) for s in seqs])),
        "response_len": _ints(array("q", [len(s.response_ids) for s in seqs])),
        "prompt_ids": _ints(_flat(seqs, "prompt_ids")),
        "response_ids": _ints(_flat(seqs, "response_ids")),
        "old_logp": _floats(_flat(seqs, "old_logp", "d")),
        "adv_per_token": torch.tensor([int(per_token)], dtype=torch.uint8),
        "advantage": _floats(
            _flat(seqs, "advantage", "d")
            if per_token
            else array("d", [float(s.advantage) for s in seqs])  # type: ignore[arg-type]
        ),
        "loss_mask": _ints(_flat(seqs, "loss_mask")),
        "rollout_logp": _floats(_flat(seqs, "rollout_logp", "d")),
        "ref_logp": _floats(_flat(seqs, "ref_logp", "d")),
        "reward": _floats(array("d", [float(s.reward or 0.0) for s in seqs])),
        "group": _ints(array("q", [int(s.group or 0) for s in seqs])),
    }
    for f in (*_OPTIONAL, *_SCALARS):
        out[f"has_{f}"] = torch.tensor([getattr(s, f) is not None for s in seqs], dtype=torch.uint8)
    out |= _pack_routes(seqs)
    return out


def _pack_routes(seqs: Sequence[TrainSequence]) -> dict[str, Tensor]:
    """rl.routing_replay: every sequence's `routed_experts` [P+R-1, L, K] end to end, with
    has_routed_experts [S] and routed_shape [2] = (L, K)."""
    routes = [s.routed_experts for s in seqs if s.routed_experts is not None]
    shape = tuple(routes[0].shape[1:]) if routes else (0, 0)
    flat = torch.cat([r.reshape(-1) for r in routes]) if routes else torch.zeros(0)
    return {
        "routed_experts": flat.to(torch.int32),
        "routed_shape": torch.tensor(shape, dtype=torch.int64),
        "has_routed_experts": torch.tensor(
            [s.routed_experts is not None for s in seqs], dtype=torch.uint8
        ),
    }


def _unpack_routes(t: dict[str, Tensor], lengths: list[int]) -> list[Tensor | None]:
    has = t["has_routed_experts"].tolist()
    layers, k = t["routed_shape"].tolist()
    rows = [n - 1 for n, h in zip(lengths, has, strict=True) if h]
    parts = iter(_split(t["routed_experts"], [r * layers * k for r in rows]))
    return [next(parts).view(-1, layers, k) if h else None for h in has]


def _split(flat: Tensor, lengths: list[int]) -> list[Tensor]:
    return list(torch.split(flat, lengths)) if lengths else []


def unpack_sequences(t: dict[str, Tensor]) -> list[TrainSequence]:
    """The inverse of `pack_sequences`: per-token fields as 1-D tensor views of `t` (no Python
    object per token; `megatron.packing.pack` reads lists and tensors alike), ids and lengths
    in the dtype they travelled in, sequence ids and per-sequence advantages as Python
    numbers. `.tolist()` on a field gives back the sender's list exactly."""
    rlen = t["response_len"].tolist()
    prompts = _split(t["prompt_ids"], t["prompt_len"].tolist())
    responses = _split(t["response_ids"], rlen)
    old = _split(t["old_logp"], rlen)
    per_token = bool(t["adv_per_token"].item())
    adv: list[Any] = _split(t["advantage"], rlen) if per_token else t["advantage"].tolist()
    optional: dict[str, list[Any]] = {}
    for f in _OPTIONAL:
        has = t[f"has_{f}"].tolist()
        parts = iter(_split(t[f], [n for n, h in zip(rlen, has, strict=True) if h]))
        optional[f] = [next(parts) if h else None for h in has]
    scalars: dict[str, list[Any]] = {}
    for f in _SCALARS:
        has = t[f"has_{f}"].tolist()
        scalars[f] = [v if h else None for v, h in zip(t[f].tolist(), has, strict=True)]
    lengths = [p + r for p, r in zip(t["prompt_len"].tolist(), rlen, strict=True)]
    routes = _unpack_routes(t, lengths)
    return [
        TrainSequence(
            seq_id=sid,
            prompt_ids=prompts[i],
            response_ids=responses[i],
            old_logp=old[i],
            advantage=adv[i],
            loss_mask=optional["loss_mask"][i],
            rollout_logp=optional["rollout_logp"][i],
            ref_logp=optional["ref_logp"][i],
            reward=scalars["reward"][i],
            group=scalars["group"][i],
            routed_experts=routes[i],
        )
        for i, sid in enumerate(t["seq_id"].tolist())
    ]


def _to_buffer(tensors: dict[str, Tensor]) -> tuple[list[tuple[str, str, int]], Tensor]:
    """One uint8 buffer with every tensor's bytes end to end, and its layout."""
    layout = [(k, str(v.dtype).removeprefix("torch."), v.numel()) for k, v in tensors.items()]
    parts = []
    for v in tensors.values():
        raw = v.contiguous().reshape(-1).view(torch.uint8)
        parts += [raw, torch.zeros(_padded(raw.numel()) - raw.numel(), dtype=torch.uint8)]
    return layout, torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _padded(nbytes: int) -> int:
    """Every part starts 8-byte aligned, so that it can be viewed as its dtype in place."""
    return -(-nbytes // 8) * 8


def _from_buffer(layout: list[tuple[str, str, int]], buf: Tensor) -> dict[str, Tensor]:
    out, at = {}, 0
    for name, dtype_name, numel in layout:
        dtype = getattr(torch, dtype_name)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        out[name] = buf[at : at + nbytes].view(dtype)
        at += _padded(nbytes)
    return out


def broadcast_sequences(
    seqs: Sequence[TrainSequence] | None, extra: Any = None, *, src: int = 0
) -> tuple[list[TrainSequence] | None, Any]:
    """`(seqs, extra)` of rank `src` on every rank (collective). `extra` is small control data
    (the step's metrics, a stop reason) and is pickled; `seqs` (None: nothing to train) travel
    as one uint8 tensor. A 1-rank job gets its arguments back."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return (None if seqs is None else list(seqs)), extra
    me = torch.distributed.get_rank()
    header: list[Any] = [None]
    buf = None
    if me == src:
        layout, buf = (None, None) if seqs is None else _to_buffer(pack_sequences(seqs))
        header = [(layout, None if buf is None else buf.numel(), extra)]
    torch.distributed.broadcast_object_list(header, src=src)
    layout, nbytes, extra = header[0]
    if layout is None:
        return None, extra
    # The collective runs on the job's device (NCCL takes device tensors only); the receivers'
    # views stay on the host, where packing reads them.
    dev = job_device()
    wire = buf.to(dev) if buf is not None else torch.empty(nbytes, dtype=torch.uint8, device=dev)
    torch.distributed.broadcast(wire, src=src)
    buf = wire.cpu()
    if me == src:  # the sender keeps its own objects (no rebuild)
        return list(seqs or []), extra
    return unpack_sequences(_from_buffer(layout, buf)), extra


def gather_logprob_rows(rows: Tensor, *, duplicate: bool = False) -> Tensor:
    """All ranks' `[N_r, 3]` float64 rows (seq id, position, log-prob), concatenated in rank
    order on every rank (collective). Ranks with `duplicate` (another rank of the group holds
    the same rows, e.g. TP ranks > 0) contribute none."""
    rows = rows.detach().to("cpu", torch.float64).reshape(-1, 3)
    if duplicate:
        rows = rows[:0]
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return rows
    world = torch.distributed.get_world_size()
    dev = job_device()  # the collectives run on the job's device (NCCL: device tensors only)
    size = torch.tensor([rows.shape[0]], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    torch.distributed.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    if longest == 0:
        return rows
    padded = torch.zeros(longest, 3, dtype=torch.float64, device=dev)
    padded[: rows.shape[0]] = rows.to(dev)
    parts = [torch.empty(longest, 3, dtype=torch.float64, device=dev) for _ in range(world)]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)]).cpu()


def logprobs_by_sequence(rows: Tensor) -> dict[int, Tensor]:
    """`{seq_id: [R] float64}` from gathered rows (rows with seq id < 0 are padding). Every
    sequence must have exactly the positions 0..R-1, once each; else a RuntimeError."""
    keep = rows[:, 0] >= 0
    sid, pos, lp = rows[keep, 0].long(), rows[keep, 1].long(), rows[keep, 2]
    if sid.numel() == 0:
        return {}
    order = torch.argsort(sid * (int(pos.max()) + 1) + pos)
    sid, pos, lp = sid[order], pos[order], lp[order]
    ids, counts = torch.unique_consecutive(sid, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    if not torch.equal(pos, torch.arange(sid.numel()) - starts):
        raise RuntimeError(
            "recomputed log-probs: a sequence's token rows are missing or repeated (each "
            "response position must come from exactly one rank)"
        )
    return dict(zip(ids.tolist(), torch.split(lp, counts.tolist()), strict=True))
