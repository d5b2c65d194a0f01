"""Verification of a weight sync: what each engine holds against what was sent.

`verify_engines` compares every engine (every TP rank of it) in the naming it reports
(SGLang's fused per-rank parameters for a real server, HF names for the embedded engine) with
the sender's checksums (`engines.weight_shards.EngineChecksums`, or the union of several
senders' `weights.owners.SentChecksums`); `verification_due` is the `weights.verify_every`
schedule. Split out of `weights.sync` (the push) so that each reads on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from megatron_gspo.engines.protocols import WeightReceiver
from megatron_gspo.engines.weight_names import reported_in_sglang_naming
from megatron_gspo.weights.checksum import WeightIntegrityError, compare_checksums

if TYPE_CHECKING:
    from megatron_gspo.engines.weight_shards import EngineChecksums
    from megatron_gspo.weights.owners import SentChecksums

__all__ = [
    "WeightSyncError",
    "engine_rank_checksums",
    "engine_tensor_checksums",
    "unwritten_parameters",
    "verification_due",
    "verify_engines",
]


class WeightSyncError(RuntimeError):
    """A weight sync failed (transport error or wrong engine version)."""


def engine_rank_checksums(info: Mapping[str, object], engine_id: str = "") -> list[dict[str, str]]:
    """Per TP rank (in TP rank order), `{name: checksum}` from one engine's
    `weights_checksum()` entry: `{"checksums": {...}}` (one rank) or SGLang's `/weights_checker`
    body `{"ranks": [{"checksums": {...}, "parallelism_info": {"tp_rank": r, ...}}, ...]}`."""
    if isinstance(info.get("checksums"), Mapping):
        return [_names(info["checksums"])]
    ranks = info.get("ranks") or []
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(isinstance(r, Mapping) and isinstance(r.get("checksums"), Mapping)
                   for r in ranks)
    ):  # fmt: skip
        raise WeightSyncError(
            f"engine {engine_id}: no per-tensor checksums in {sorted(info)}; set "
            "weights.verify_every=0 for engines that cannot report them"
        )

    def tp_rank(i: int) -> int:
        r = ranks[i]
        par = r.get("parallelism_info") or {}
        if isinstance(par, list):  # one entry per role (target / draft): the target's
            par = next((p for p in par if p.get("role", "target") == "target"), {})
        return int(r.get("tp_rank", par.get("tp_rank", i)))

    order = sorted(range(len(ranks)), key=tp_rank)
    got = [tp_rank(i) for i in order]
    if got != list(range(len(ranks))):
        raise WeightSyncError(f"engine {engine_id}: TP ranks {got} are not 0..{len(ranks) - 1}")
    return [_names(ranks[i]["checksums"]) for i in order]


def _names(checksums: object) -> dict[str, str]:
    assert isinstance(checksums, Mapping)  # checked by the caller
    return {str(k): str(v) for k, v in checksums.items()}


def engine_tensor_checksums(info: Mapping[str, object], engine_id: str = "") -> dict[str, str]:
    """The checksums of a one-TP-rank engine (HF or SGLang names); see `engine_rank_checksums`."""
    per_rank = engine_rank_checksums(info, engine_id)
    if len(per_rank) != 1:
        raise WeightSyncError(f"engine {engine_id}: {len(per_rank)} TP ranks, expected 1")
    return per_rank[0]


def verification_due(version: int, verify_every: int, *, verified_before: bool) -> bool:
    """Whether push `version` is verified by schedule: never with `verify_every` 0; else the
    first push of this `WeightSync` (an engine serving another model is refused before step 1)
    and every push whose version is a multiple of `verify_every`. (`WeightSync.push` also
    verifies every push that an engine re-joins.)"""
    if verify_every <= 0:
        return False
    return not verified_before or version % verify_every == 0


def verify_engines(
    engines: Sequence[WeightReceiver],
    sent: EngineChecksums | SentChecksums,
    *,
    verify_names: Literal["all", "common"] = "all",
) -> frozenset[str]:
    """Raise `WeightIntegrityError` unless every engine (every TP rank of it) holds what was
    sent. Each engine is compared in the naming it reports: SGLang's fused parameter names
    over each rank's shard when it reports them (a real server), else HF names (the embedded
    engine). Returns the namings seen ("sglang", "hf"), so later pushes hash only those."""
    namings: set[str] = set()
    for engine in engines:
        for engine_id, info in engine.weights_checksum().items():
            per_rank = engine_rank_checksums(info, engine_id)
            if reported_in_sglang_naming(per_rank[0]):
                namings.add("sglang")
                expected_ranks = sent.ranks(len(per_rank))
            elif len(per_rank) == 1:
                namings.add("hf")
                expected_ranks = [sent.hf]
            else:
                raise WeightSyncError(
                    f"engine {engine_id}: {len(per_rank)} TP ranks report HF names; only "
                    "SGLang's fused per-rank naming can be verified"
                )
            for r, (expected, held) in enumerate(zip(expected_ranks, per_rank, strict=True)):
                where = engine_id if len(per_rank) == 1 else f"{engine_id} TP rank {r}"
                if verify_names == "common":
                    expected = {n: c for n, c in expected.items() if n in held}
                    if not expected:
                        raise WeightIntegrityError(
                            f"engine {where} reports no checksum under any sent name"
                        )
                else:
                    unwritten_parameters(expected, held, where)
                compare_checksums(expected, held, where)
    return frozenset(namings)


def unwritten_parameters(sent: dict[str, str], held: dict[str, str], engine_id: str) -> None:
    """Raise `WeightIntegrityError` when the engine holds parameters the push did not write
    (another model: an extra layer, expert or head keeps its own weights while every sent
    tensor matches). Only weights count: a real server also reports buffers (rotary caches),
    which no checkpoint holds."""
    extra = sorted(n for n in held if n not in sent and n.endswith((".weight", ".bias")))
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise WeightIntegrityError(
            f"engine {engine_id} holds {len(extra)} parameters the push did not write: "
            f"{', '.join(extra[:3])}{more}; it serves another model than the trainer"
        )
