"""`weights.senders=owners`: every rank that holds a shard sends it (issue 36, part 2).

One 4-rank launch (tests/weights/owners_ranks.py) pushes the tiny MoE into real embedded
engines, first by today's path (rank 0 gathers the experts and sends everything), then with
every rank sending its own shard, on one node (EP=4) and on two "nodes" (EP=2 in each, one
engine per node). The reference for the weights is today's path and the bridge's own export;
the reference for the traffic is the same counters on today's path.
"""

from __future__ import annotations

import pytest

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.weights import owners_ranks

pytestmark = pytest.mark.multirank
WORLD = 4
SCENARIOS = ("ep4", "ep2_2nodes")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    root = tmp_path_factory.mktemp("owners")
    hf_dir = str(save_tiny_hf_checkpoint(root / "hf", seed=0))
    return spawn_ranks(owners_ranks.main, WORLD, hf_dir, str(root))


def _through(info: dict) -> int:
    """Bytes through one rank: received over collectives + sent to engines."""
    return info["received"] + info["sent"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engines_hold_what_todays_path_wrote(results: list[dict], scenario: str) -> None:
    """Every parameter of every engine equals today's push and the bridge's export."""
    engines = [r[scenario] for r in results if "engine_vs_today" in r[scenario]]
    assert len(engines) == (1 if scenario == "ep4" else 2)
    for eng in engines:
        assert eng["engine_vs_today"] == [], eng["engine_vs_today"][:5]
        assert eng["engine_vs_export"] == []
        # Every engine parameter compared with today's push (each engine starts from another
        # checkpoint, so a tensor no sender wrote differs), most also with the export by name.
        assert eng["engine_params"] >= 20 and eng["engine_params_exported"] >= 20
    owners = results[0][scenario]["owners"]
    assert owners["push"] == 2 and owners["verified"]  # rank 0 checked every sender's hashes
    assert owners["version"] == 2 and set(owners["engine_version"].values()) == {"2"}
    assert all(r[scenario]["owners"]["version"] == 2 for r in results)  # one outcome


def test_busiest_rank_carries_at_most_2_over_n(results: list[dict]) -> None:
    """One node, n = 4 senders: the busiest rank moves <= 2/n of the model (today: rank 0
    receives the other ranks' experts and sends the whole model)."""
    model = results[0]["ep4"]["model_bytes"]
    today = [_through(r["ep4"]["one"]) for r in results]
    owners = [_through(r["ep4"]["owners"]) for r in results]
    assert max(today) > model  # the old path's rank 0: the reference that can fail
    assert max(owners) <= 2 * model / WORLD, (owners, model)
    assert all(r["ep4"]["owners"]["received"] == 0 for r in results)  # nothing gathered
    # Each tensor sent once: the senders' bytes add up to the model, every rank sends some.
    by_rank = results[0]["ep4"]["owners"]["bytes_by_rank"]
    assert sum(by_rank) == model and min(by_rank) > 0, by_rank


def test_each_node_feeds_its_own_engine(results: list[dict]) -> None:
    """Two nodes: each engine is written only by its own node's ranks, which together send it
    every tensor exactly once (node 1's engine never hears from node 0 and vice versa)."""
    engines = {r["ep2_2nodes"]["node"]: None for r in results}
    names_by_node: dict[int, list[str]] = {n: [] for n in engines}
    urls_by_node: dict[int, set[str]] = {n: set() for n in engines}
    for r in results:
        s = r["ep2_2nodes"]
        for url, _, names in s["owners"]["records"]:
            urls_by_node[s["node"]].add(url)
            names_by_node[s["node"]] += names
        assert s["owners"]["sent"] > 0  # every rank sent part of its node's copy
    assert len(urls_by_node) == 2 and all(len(u) == 1 for u in urls_by_node.values())
    assert urls_by_node[0].isdisjoint(urls_by_node[1])
    for names in names_by_node.values():
        assert len(names) == len(set(names)) == results[0]["ep2_2nodes"]["owners"]["tensors"] / 2
