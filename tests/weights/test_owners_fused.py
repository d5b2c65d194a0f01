"""`weights/owners_fused.py` without ranks: when every sender can send SGLang's own layout,
that every rank of a send scope takes the same decisions, and that a sender's partial
`w13_weight` / `w2_weight` (its local experts) gives each engine rank it covers exactly what
the one-sender push gives it. The multi-rank pushes are in test_owners.py."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.weight_layout import (
    FusedParts,
    fused_stream,
    member_names,
    rank_pieces,
    rank_tensors,
)
from megatron_gspo.engines.weight_names import sglang_slot
from megatron_gspo.weights.owners import SenderGrid
from megatron_gspo.weights.owners_fused import ExpertRoute, _Experts, _Loads, expert_route
from tests.engines.test_weight_shards import _T, E, _layout


def _grid(rank: int, ep_ranks: tuple[int, ...], nodes: tuple[int, ...] | None = None) -> SenderGrid:
    n = len(ep_ranks)
    return SenderGrid(
        rank=rank,
        nodes=nodes or (0,) * n,
        ep_ranks=ep_ranks,
        per_node=True,
        sending=(True,) * n,
        engine_eps=(frozenset({1}),) * n,
    )


@pytest.mark.parametrize(
    ("trainer_ep", "engine_eps", "experts", "peers"),
    [(4, {1}, 8, 4), (4, {2}, 8, 2), (4, {4}, 8, 1), (2, {8}, 8, 1), (4, {3}, 12, None),
     (2, {1, 2}, 8, None)],
)  # fmt: skip
def test_route_when_ep_sizes_nest_else_why(
    trainer_ep: int, engine_eps: set[int], experts: int, peers: int | None
) -> None:
    grid = _grid(0, tuple(range(trainer_ep)))
    route, why = expert_route(grid, engine_eps, experts)
    if peers is None:
        assert route is None and ("nest" in why or "differ" in why), why
    else:
        assert route is not None and route.peers == peers and why == ""


def test_replicas_of_unequal_count_fall_back() -> None:
    route, why = expert_route(_grid(0, (0, 0, 1)), {1}, 4)
    assert route is None and "replica" in why


@pytest.mark.parametrize(
    ("ep_ranks", "nodes", "k"),
    [((0, 1, 0, 1), None, 2), ((0, 1, 0, 1), None, 1), ((0, 1, 2, 3), None, 4),
     ((0, 1, 0, 1), (0, 0, 1, 1), 2)],
    ids=["dp2-ep2-gather", "dp2-ep2-own", "ep4-gather-all", "two-nodes"],
)  # fmt: skip
def test_every_rank_of_a_scope_takes_the_same_decisions(
    ep_ranks: tuple[int, ...], nodes: tuple[int, ...] | None, k: int
) -> None:
    """Each rank decides alone who receives and who sends each expert parameter (no
    communication): the ranks of a unit must agree, every unit's peers hold its EP ranks in
    order, and the receivers spread over the scope."""
    t = max(ep_ranks) + 1
    route = ExpertRoute(trainer_ep=t, engine_ep=t // k, num_experts=8)
    grids = [_grid(r, ep_ranks, nodes) for r in range(len(ep_ranks))]
    experts = [_Experts(g, route, _Loads(g.scope())) for g in grids]
    receivers = set()
    for share in (300, 100, 300, 100, 300, 100):  # w13, w2 of three layers
        decided = [x._assign(share) for x in experts]
        for r, (receiver, peers) in enumerate(decided):
            scope = grids[r].scope()
            unit = [q for q in scope if ep_ranks[q] // k == ep_ranks[r] // k]  # same experts
            assert all(decided[q] == decided[r] for q in unit)
            assert receiver in peers and set(peers) <= set(scope)
            first = ep_ranks[r] - ep_ranks[r] % k
            assert [ep_ranks[p] for p in peers] == [first + j for j in range(k)]
            receivers.add(receiver)
    assert len(receivers) > 1
    for x in experts:  # every rank of a scope tracked the same loads
        same = [y for y in experts if y.grid.scope() == x.grid.scope()]
        assert all(y.loads.by_rank == x.loads.by_rank for y in same)


def _local_parts(group: str, experts: range) -> FusedParts:
    """A trainer EP rank's (or a gathered subgroup's) members of one expert parameter."""
    keys = [k for n in _T if (s := sglang_slot(n)) and s[0] == group for k in [s[1]]]
    keys = sorted(k for k in keys if k[0] in experts)
    names = member_names(group, keys)
    return FusedParts(group, [(n, _T[n]) for n in names])


@pytest.mark.parametrize(
    ("trainer_ep", "tp", "ep"), [(2, 4, 4), (2, 2, 2), (4, 2, 2), (4, 4, 1), (2, 2, 1)]
)
def test_a_senders_experts_give_each_engine_rank_it_covers_what_one_sender_gives(
    trainer_ep: int, tp: int, ep: int
) -> None:
    """Engine EP a multiple of the trainer's (one trainer rank covers several engine ranks),
    equal, or a divisor (k trainer ranks' experts gathered): the pieces an engine rank gets
    from the sender holding its experts equal, bitwise, what the one-sender push (all experts
    fused in one place) gives it; the other senders give it nothing of the parameter."""
    lay = _layout(tp, ep)
    whole = dict(fused_stream(list(_T.items()), num_experts=E))
    k = trainer_ep // ep if trainer_ep > ep else 1
    per = E // trainer_ep
    for group in ("model.layers.0.mlp.experts.w13_weight", "model.layers.0.mlp.experts.w2_weight"):
        for unit in range(trainer_ep // k):
            held = range(unit * k * per, (unit + 1) * k * per)
            parts = _local_parts(group, held)
            for r in range(tp):
                want = rank_tensors([(group, whole[group])], r, lay)
                got = rank_pieces([(group, parts)], r, lay)
                covers = (r // lay.moe_tp) * (E // ep) in held
                if not covers:
                    assert got == [], (group, unit, r)
                    continue
                (name, expected), (piece,) = want[0], got
                flat = torch.cat([s.reshape(-1) for s in piece.sources])
                assert piece.name == name and piece.shape == tuple(expected.shape)
                assert torch.equal(flat, expected.reshape(-1)), (group, unit, r)


def test_layouts_that_do_not_nest_send_hf_names_and_say_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`WeightSync` takes the route only where it applies; otherwise HF names, one log line."""
    from types import SimpleNamespace

    from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
    from tests.weights.fake_engine import FakeEngine

    hf = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 12}
    bridge = SimpleNamespace(hf_pretrained=SimpleNamespace(config=hf))
    sync = WeightSync(bridge, [FakeEngine()], WeightSyncConfig(senders="owners"))
    assert sync.layout == "engine"  # auto: SGLang's layout with owners too
    nested = _grid(0, (0, 1, 2, 3))
    odd = SenderGrid(**{**{f: getattr(nested, f) for f in nested.__slots__},
                        "engine_eps": (frozenset({3}),) * 4})  # fmt: skip
    with caplog.at_level("WARNING", logger="megatron_gspo.weights.sync"):
        route = sync._owner_route(nested, True)
        assert route is not None and route.peers == 4
        assert sync._owner_route(odd, True) is None and sync._owner_route(odd, True) is None
    said = [r.getMessage() for r in caplog.records if "HF names" in r.getMessage()]
    assert len(said) == 1 and "do not nest" in said[0], said
    hf_sync = WeightSync(bridge, [FakeEngine()], WeightSyncConfig(senders="owners", layout="hf"))
    assert hf_sync._owner_route(nested, True) is None


def test_slices_only_where_every_senders_engines_load_them_and_say_who_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each holder sends its experts as slices only when every sending rank's engines load
    them (the same decision on every rank, from the gathered grid); otherwise the experts are
    gathered, and an unverified push says once which ranks' engines hold it back."""
    from types import SimpleNamespace

    from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
    from tests.weights.fake_engine import FakeEngine

    hf = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8}
    bridge = SimpleNamespace(hf_pretrained=SimpleNamespace(config=hf))
    sync = WeightSync(bridge, [FakeEngine()], WeightSyncConfig(senders="owners"))
    base = _grid(0, (0, 1, 2, 3))
    fields = {f: getattr(base, f) for f in base.__slots__}
    every = SenderGrid(**{**fields, "slices": (True,) * 4})
    one_not = SenderGrid(**{**fields, "slices": (True, True, False, True)})
    idle = SenderGrid(**{**fields, "slices": (True, True, False, True),
                         "sending": (True, True, False, True)})  # fmt: skip
    with caplog.at_level("WARNING", logger="megatron_gspo.weights.sync"):
        assert sync._owner_route(every, False).slices
        assert sync._owner_route(idle, False).slices  # a rank that sends nothing: no vote
        assert not sync._owner_route(one_not, True).slices  # verified: nothing said
        assert not sync._owner_route(one_not, False).slices
        assert not sync._owner_route(one_not, False).slices
    said = [r.getMessage() for r in caplog.records if "expert slices" in r.getMessage()]
    assert len(said) == 1 and "rank(s) [2]" in said[0], said
    engine = FakeEngine()
    cfg = WeightSyncConfig(senders="owners", expert_slices="off")
    off = WeightSync(bridge, [engine], cfg, send_engines=[engine])
    engine.slices = True
    assert not off._send_slices(False)
    auto = WeightSync(bridge, [engine], WeightSyncConfig(senders="owners"), send_engines=[engine])
    assert auto._send_slices(False) and not auto._send_slices(True)
    named = WeightSyncConfig(senders="owners", layout="hf")  # HF names: nothing to slice
    assert not WeightSync(bridge, [engine], named, send_engines=[engine])._send_slices(False)
    engine.slices = False
    assert not auto._send_slices(False)


def test_the_planner_counts_a_stacked_parameter_larger_than_a_bucket() -> None:
    """In SGLang's layout a layer's stacked experts leave whole (gathered into one rank with
    owners where an engine rank's experts are spread): a bucket in flight is up to that size.
    Qwen3-30B-A3B's `w13_weight` (128 x 2 x 768 x 2048 bf16 = 805 MB) fits the recipe's 1 GiB
    buckets (its planned buffers unchanged) but not 512 MiB ones."""
    from types import SimpleNamespace

    from megatron_gspo.plan.memory import push_buffer_bytes, stacked_expert_bytes
    from megatron_gspo.weights.config import WeightSyncConfig

    hf = SimpleNamespace(num_experts=128, moe_intermediate_size=768, hidden_size=2048)
    cfg = SimpleNamespace(weights=WeightSyncConfig(senders="owners"))
    stacked = stacked_expert_bytes(cfg, hf, 2)  # type: ignore[arg-type]
    assert stacked == 128 * 2 * 768 * 2048 * 2
    hf_named = SimpleNamespace(weights=WeightSyncConfig(senders="owners", layout="hf"))
    assert stacked_expert_bytes(hf_named, hf, 2) == 0  # type: ignore[arg-type]
    assert push_buffer_bytes(1024**3, "owners", stacked) == 3 * 1024**3
    assert push_buffer_bytes(512 * 1024**2, "owners", stacked) == 3 * stacked
    # Colocated: each GPU sends its own engine rank's part only (the home path), 1/TP of it.
    launch = SimpleNamespace(colocated=True, tp_size=2)
    home = SimpleNamespace(weights=cfg.weights, rollout=SimpleNamespace(launch=launch))
    assert stacked_expert_bytes(home, hf, 2) == stacked / 2  # type: ignore[arg-type]
