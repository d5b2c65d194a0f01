"""`weights/owners_home.py` without ranks: when every engine rank has a home (the trainer rank
on its GPU) and why not, who sends each engine rank's experts, and that a home's cut of a
parameter reaches its engine rank alone through SGLang's own `direct` wire (the other ranks
get an empty list). The multi-rank pushes are in test_owners.py."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.weight_layout import FusedParts, RankCut, fused_stream, rank_pieces
from megatron_gspo.engines.wire import deserialize_named_tensors, direct_payloads_for_engines
from megatron_gspo.weights.owners import SenderGrid
from megatron_gspo.weights.owners_fused import _Loads
from megatron_gspo.weights.owners_home import EngineRank, _cut, _plan, expert_transfers
from tests.engines.test_weight_shards import _T, E, _layout


def _grid(nodes: tuple[int, ...], ep_ranks: tuple[int, ...], per_node: bool = True) -> SenderGrid:
    n = len(nodes)
    return SenderGrid(
        rank=0,
        nodes=nodes,
        ep_ranks=ep_ranks,
        per_node=per_node,
        sending=(True,) * n,
        engine_eps=(frozenset({1}),) * n,
    )


def test_every_engine_rank_gets_the_trainer_rank_on_its_gpu() -> None:
    """Two nodes of 2 ranks, one TP-2 engine per node on GPUs 0-1: local rank g feeds engine
    rank g of its node's engine."""
    grid = _grid((0, 0, 1, 1), (0, 1, 0, 1))
    engines = [(2, (0, 1))]
    homes, why = _plan(grid, [(r % 2, engines, True) for r in range(4)])
    assert why == ""
    assert homes == (
        (EngineRank(0, 2, 0, 0), EngineRank(0, 2, 1, 1)),
        (EngineRank(0, 2, 0, 2), EngineRank(0, 2, 1, 3)),
    )


@pytest.mark.parametrize(
    ("engines", "gpus", "per_node", "said"),
    [
        ([(2, None)], (0, 1), True, "does not say which GPUs"),
        ([(2, (2, 3))], (0, 1), True, "no trainer rank runs"),
        ([(1, (0,)), (1, (0,))], (0, 1), True, "two engine ranks"),
        ([(2, (0, 1))], (0, 0), True, "train on one GPU"),
        ([(2, (0, 1))], (0, 1), False, "not the tensor transport"),
    ],
    ids=["gpus-unknown", "disaggregated", "two-on-one-gpu", "ranks-share-a-gpu", "distributed"],
)
def test_where_it_does_not_apply_it_says_why(
    engines: list, gpus: tuple[int, int], per_node: bool, said: str
) -> None:
    grid = _grid((0, 0), (0, 1), per_node)
    homes, why = _plan(grid, [(g, engines, True) for g in gpus])
    assert homes == () and said in why, why


@pytest.mark.parametrize(("tp", "ep", "moved"), [(8, 8, 0), (2, 1, 7)])
def test_experts_move_only_where_the_home_lacks_them(tp: int, ep: int, moved: int) -> None:
    """One node of 8 trainer EP ranks: into one TP-8 / EP-8 engine each home holds exactly its
    engine rank's experts (no transfer between ranks); into four TP-2 / EP-1 engines each home
    needs a slice of every expert, 7 of 8 trainer EP ranks' from peers, spread over them."""
    model = _layout(1, ep)
    model = type(model)(1, ep, model.num_heads, model.num_kv_heads, model.head_dim, 8 * 4)
    homes = [EngineRank(g // tp, tp, g % tp, g) for g in range(8)]
    loads = _Loads(list(range(8)))
    moves = expert_transfers(homes, range(8), range(8), model, 8, loads, 100)
    for h in homes:
        mine = [m for m in moves if m.home == h]
        assert sum(m.source != h.home for m in mine) == moved
        got = sorted(e for m in mine for e in m.experts)
        per = 32 // ep
        assert got == list(range(h.rank // (tp // ep) * per, (h.rank // (tp // ep) + 1) * per))
    sources = [m.source for m in moves if m.source != m.home.home]
    if sources:  # every rank passes on about as much as every other
        counts = [sources.count(r) for r in range(8)]
        assert max(counts) - min(counts) <= 1, counts


def test_a_homes_cut_reaches_its_engine_rank_alone() -> None:
    """A `RankCut` of TP rank 1 of a TP-2 engine: rank 1's entry of the `direct` payload,
    decoded by SGLang's own unpickler, is what the one-sender push gives rank 1 (every fused
    parameter of the test model); rank 0's entry is an empty list (loads nothing)."""
    lay = _layout(2, 2)
    whole = list(fused_stream(list(_T.items()), num_experts=E, lazy=True))
    home = EngineRank(0, 2, 1, 5)
    cuts = [(n, c) for n, item in whole if (c := _cut(n, item, home, lay)) is not None]
    assert all(isinstance(c, RankCut) for _, c in cuts) and len(cuts) > 5
    per_rank = [rank_pieces(cuts, r, lay) for r in range(2)]
    assert per_rank[0] == []
    (payloads,), _keep = direct_payloads_for_engines(per_rank, 1)
    assert deserialize_named_tensors(payloads[0], "direct") == []
    got = deserialize_named_tensors(payloads[1], "direct")
    want = [(p.name, p) for p in rank_pieces(whole, 1, lay)]
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, t), (_, p) in zip(got, want, strict=True):
        ref = torch.cat([s.reshape(-1).to(p.dtype) for s in p.sources]).view(p.shape)
        assert torch.equal(t, ref)
    # Engines that report HF names hash the members as exported, not the rank's part.
    name, item = next((n, i) for n, i in whole if isinstance(i, FusedParts))
    cut = _cut(name, item, EngineRank(0, 2, 0, 0), lay)
    assert cut is not None and [n for n, _ in cut.members()] == [n for n, _ in item.parts]


def test_a_nodes_sender_client_knows_its_engines_gpus() -> None:
    """Two nodes x two TP-2 engines from GPU 0 (colocated): node 1's sender client covers its
    own two engines, on GPUs 0-1 and 2-3; `one_engine` narrows it to one engine, sharing the
    pool (engines rank 0 dropped stay dropped)."""
    from megatron_gspo.engines.client_config import ClientConfig
    from megatron_gspo.engines.connect import sender_client
    from megatron_gspo.engines.launch import LaunchConfig
    from megatron_gspo.engines.nodes import LaunchedEngines, engine_gpu_ids

    launch = LaunchConfig(model_path="m", num_engines=4, tp_size=2, colocated=True)
    assert engine_gpu_ids(launch, [2, 2]) == [[0, 1], [2, 3], [0, 1], [2, 3]]
    moved = LaunchConfig(model_path="m", num_engines=1, tp_size=2, base_gpu_id=4)
    assert engine_gpu_ids(moved, [1]) == [[4, 5]]  # engines beside the trainer's GPUs
    urls = [f"http://h{n}:{30000 + i}" for n in (0, 1) for i in (0, 1)]
    launched = LaunchedEngines(
        urls=urls, tp_sizes=[2] * 4, api_key=None, per_node=[2, 2],
        gpu_ids=engine_gpu_ids(launch, [2, 2]),
    )  # fmt: skip
    client = sender_client(ClientConfig(engine_urls=urls[:1]), launched, node=1)
    assert client is not None and client.config.engine_urls == urls[2:]
    assert client.engine_gpu_ids == [[0, 1], [2, 3]]
    one = client.one_engine(1)
    assert one.config.engine_urls == [urls[3]] and one.engine_gpu_ids == [[2, 3]]
    assert one.engine_tp_sizes() == [2] and one.pool is client.pool
    one.close()
    client.close()


def test_engines_started_outside_the_job_say_their_gpus_in_the_config() -> None:
    """`rollout.client.engine_gpu_ids` (the planner's Slurm launch sets it): the sender client
    of engines the job did not launch carries them; one list per engine, one GPU per TP rank,
    or one line naming the key."""
    from megatron_gspo.config_io import ConfigError
    from megatron_gspo.engines.client_config import ClientConfig
    from megatron_gspo.engines.connect import sender_client

    urls = ["http://h:30000", "http://h:30001"]
    cfg = ClientConfig(engine_urls=urls, engine_tp_sizes=[2, 2], engine_gpu_ids=[[0, 1], [2, 3]])
    client = sender_client(cfg, None, node=0)
    assert client is not None and client.engine_gpu_ids == [[0, 1], [2, 3]]
    client.close()
    with pytest.raises(ConfigError, match="rollout.client.engine_gpu_ids"):
        ClientConfig(engine_urls=urls, engine_tp_sizes=[2, 2], engine_gpu_ids=[[0, 1]])
    with pytest.raises(ConfigError, match="rollout.client.engine_gpu_ids"):
        ClientConfig(engine_urls=urls[:1], engine_tp_sizes=[2], engine_gpu_ids=[[0]])
