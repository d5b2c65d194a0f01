"""`weights.senders=owners`: every rank that holds a shard sends it (issue 36, part 2).

One 4-rank launch (tests/weights/owners_ranks.py) pushes the tiny MoE into real embedded
engines, first by today's path (rank 0 gathers the experts and sends everything), then with
every rank sending its own shard, on one node (EP=4) and on two "nodes" (EP=2 in each, one
engine per node), and into TP-2 engines that decode SGLang's `direct` wire per rank
(`RankFilesEngine`): one sender, every rank per parameter, and the colocated home path (each
engine rank fed by the trainer rank on its GPU, two "nodes"). The reference for the weights is
today's path and the bridge's own export; the reference for the traffic is the same counters
on today's path.
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


@pytest.mark.parametrize(
    "path",
    ["owners_hf", "owners", "one_grouped"],
    ids=["hf-names", "sglang-layout", "one-sender-grouped"],
)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_engines_hold_what_todays_path_wrote(results: list[dict], scenario: str, path: str) -> None:
    """Every parameter of every engine equals today's push (one sender, the experts from the
    bridge's export) and the bridge's export, whether the senders send HF names or SGLang's
    own layout (the embedded engine unfuses it), and whether the experts come from the
    bridge or straight from the Megatron parameters (`one_grouped`, `owners`)."""
    engines = [r[scenario] for r in results if "engine_vs_today" in r[scenario][path]]
    assert len(engines) == (1 if scenario == "ep4" else 2)
    for eng in engines:
        assert eng[path]["engine_vs_today"] == [], eng[path]["engine_vs_today"][:5]
        assert eng[path]["engine_vs_export"] == []
        # Every engine parameter compared with today's push (each engine starts from another
        # checkpoint, so a tensor no sender wrote differs), most also with the export by name.
        assert eng["engine_params"] >= 20 and eng["engine_params_exported"] >= 20
    owners = results[0][scenario][path]
    pushes = 1 if path == "one_grouped" else 2
    assert owners["push"] == pushes and owners["verified"]  # rank 0 checked the senders' hashes
    assert owners["version"] == pushes
    assert set(owners["engine_version"].values()) == {str(pushes)}
    assert all(r[scenario][path]["version"] == pushes for r in results)  # one outcome


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_experts_come_straight_from_the_megatron_parameters(
    results: list[dict], scenario: str
) -> None:
    """`weights.grouped_export` (issue 36): on every rank (EP 4; EP 2 per "node") the expert
    members taken from the Megatron parameters are bitwise what the bridge's export yields
    for them (names, bytes, the EP registry: the slot's name on every EP rank) and what its
    all-gathered export holds, and the bridge's remaining tasks export no expert; the pushes
    in SGLang's layout took them (the bridge walked none of them), the reference and the
    HF-named push did not (their engines compared bitwise above)."""
    ep = 4 if scenario == "ep4" else 2
    for r in results:
        g = r[scenario]["grouped"]
        assert g["why"] == "" and g["members"] == 2 * (4 // ep) * 3  # layers x local x 3
        assert g["registered"] == g["members"]  # each with its slot's names on every EP rank
        for key in ("names_differ", "unequal", "unequal_to_export", "stale"):
            assert g[key] == [], (key, g[key][:5])
        assert g["rest_experts"] == [] and g["covered"] == []
        paths = r[scenario]
        assert paths["one"]["direct"] == paths["owners_hf"]["direct"] == 0
        assert paths["one_grouped"]["direct"] == paths["owners"]["direct"] == g["members"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_unverified_pushes_send_each_ranks_experts_as_slices(
    results: list[dict], scenario: str
) -> None:
    """`weights.expert_slices` (auto): an unverified owners push into engines that load
    slices (the embedded engine, as SGLang with our `--custom-weight-loader`) moves no expert
    between trainer ranks: each EP rank sends its own experts as a slice of the one-rank
    engine's stacked parameters (`<param>@experts=<i>`, at its first expert), and the engine
    holds bitwise what today's path wrote. The verified owners push sends whole parameters
    (the engine hashes whole ones), so its experts were gathered first."""
    ep = 4 if scenario == "ep4" else 2
    local = 4 // ep
    layers = results[0][scenario]["grouped"]["members"] // (3 * local)
    for r in results:
        s = r[scenario]
        ep_rank = r["rank"] % ep
        sliced = [n for _, _, names in s["owners_slices"]["records"] for n in names]
        sliced = [n for n in sliced if "@experts=" in n]
        assert len(sliced) == 2 * layers, sliced  # w13 and w2 of every MoE layer
        assert {n.rsplit("=", 1)[1] for n in sliced} == {str(ep_rank * local)}
        assert s["owners_slices"]["received"] == 0  # no expert crossed between ranks
        whole = [n for _, _, names in s["owners"]["records"] for n in names]
        assert not any("@experts=" in n for n in whole)
        assert s["owners_slices"]["version"] == 2 and not s["owners_slices"]["verified"]
    assert sum(r[scenario]["owners"]["received"] for r in results) > 0  # the gather's bytes
    engines = [r[scenario]["owners_slices"] for r in results]
    engines = [e for e in engines if "engine_vs_today" in e]
    assert len(engines) == (1 if scenario == "ep4" else 2)
    for eng in engines:
        assert eng["engine_vs_today"] == [] and eng["engine_vs_export"] == []


def test_busiest_rank_carries_at_most_2_over_n(results: list[dict]) -> None:
    """One node, n = 4 senders: the busiest rank moves <= 2/n of the model (today: rank 0
    receives the other ranks' experts and sends the whole model), in HF names and in SGLang's
    layout (there each layer's experts are gathered to one rank: the one-rank engine stacks
    them all, so ranks also receive)."""
    model = results[0]["ep4"]["model_bytes"]
    today = [_through(r["ep4"]["one"]) for r in results]
    assert max(today) > model  # the old path's rank 0: the reference that can fail
    for path in ("owners_hf", "owners"):
        owners = [_through(r["ep4"][path]) for r in results]
        assert max(owners) <= 2 * model / WORLD, (path, owners, model)
        # Each tensor sent once: the senders' bytes add up to the model, every rank sends some.
        by_rank = results[0]["ep4"][path]["bytes_by_rank"]
        assert sum(by_rank) == model and min(by_rank) > 0, by_rank
    assert all(r["ep4"]["owners_hf"]["received"] == 0 for r in results)  # nothing gathered
    # SGLang's layout: one tensor per fused parameter, as many as the one sender's push
    assert results[0]["ep4"]["owners"]["tensors"] == results[0]["ep4"]["one"]["tensors"]
    assert results[0]["ep4"]["owners"]["tensors"] < results[0]["ep4"]["owners_hf"]["tensors"]


def test_each_node_feeds_its_own_engine(results: list[dict]) -> None:
    """Two nodes: each engine is written only by its own node's ranks, which together send it
    every tensor exactly once (node 1's engine never hears from node 0 and vice versa), in
    SGLang's own layout."""
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
        assert any(n.endswith(".experts.w13_weight") for n in names)  # SGLang's names


@pytest.mark.parametrize("engine_ep", [2, 1], ids=["engine-ep2-no-gather", "engine-ep1-gathers"])
def test_every_engine_rank_holds_what_one_sender_wrote(results: list[dict], engine_ep: int) -> None:
    """Trainer EP 2 (x DP 2) into a TP-2 engine in SGLang's own layout: every rank's fused
    parameters equal the one-sender push's bitwise, the push is verified against what each
    engine rank reports (SGLang's hash, per rank, fused names) and stamped once. Engine EP 2:
    each trainer EP rank builds its own engine rank's `w13_weight` / `w2_weight`, so no rank
    receives a byte; engine EP 1: each engine rank holds a slice of every expert, gathered
    per parameter between the two EP ranks (not to rank 0)."""
    files = [r["files_ep2"] for r in results]
    assert files[0][f"ep{engine_ep}_diff"] == [], files[0][f"ep{engine_ep}_diff"][:5]
    assert files[0][f"ep{engine_ep}_params"] >= 40  # 21 parameters x 2 engine ranks
    for f in files:
        owners = f[f"ep{engine_ep}_owners"]
        assert owners["verified"] and owners["version"] == "1"
        # the reference walked the bridge's experts, the owners took them from the parameters
        assert f[f"ep{engine_ep}_one"]["direct"] == 0 and owners["direct"] == 2 * 2 * 3
        assert owners["engine_tensors"] > 0  # every rank sent some engine ranks' parameters
    received = [f[f"ep{engine_ep}_owners"]["received"] for f in files]
    if engine_ep == 2:
        assert received == [0, 0, 0, 0]
    else:
        assert 0 < max(received) < files[0]["ep1_one"]["received"]
    # One sender: rank 0 received the other EP rank's experts; no rank of the owners push
    # moves as much as it did.
    one = _through(files[0][f"ep{engine_ep}_one"])
    assert max(_through(f[f"ep{engine_ep}_owners"]) for f in files) < one / 2


def test_a_corrupted_engine_rank_is_caught(results: list[dict]) -> None:
    """Each sender hashes what it sent each engine rank; a parameter corrupted on arrival at
    one rank fails the push, naming it."""
    caught = results[0]["files_ep2"]["corrupt_caught"]
    assert "WeightIntegrityError" in caught and "w2_weight" in caught, caught
    assert "TP rank 1" in caught, caught


@pytest.mark.parametrize("engine_ep", [2, 1], ids=["trainer-ep-eq-engine-ep", "engine-ep1"])
def test_each_engine_rank_is_fed_from_its_own_gpu(results: list[dict], engine_ep: int) -> None:
    """Colocated (two "nodes" of 2 ranks, trainer EP 2, one TP-2 engine per node "on GPUs
    0-1"): every payload an engine rank loads came from the trainer rank on its GPU (local
    rank r feeds engine rank r: no CUDA-IPC handle would cross GPUs), the engines hold
    bitwise what the one-sender push wrote, the push is verified and stamped once. Trainer
    EP = engine EP: no byte moves between trainer ranks; engine EP 1: each home receives
    only its engine rank's slice of the other EP rank's experts (half of what it loads)."""
    home = [r["files_ep2"][f"ep{engine_ep}_home"] for r in results]
    assert results[0]["files_ep2"][f"ep{engine_ep}_home_diff"] == [[], []]
    for node, writers in enumerate(home[0]["writers"]):
        assert writers == {0: {2 * node}, 1: {2 * node + 1}}, (node, writers)
    for h in home:
        assert h["verified"] and h["versions"] == ["1", "1"]
        assert h["sent"] > 0
        assert h["direct"] == 2 * 2 * 3  # the experts straight from the Megatron parameters
    received = [h["received"] for h in home]
    if engine_ep == 2:
        assert received == [0, 0, 0, 0]
    else:
        assert received == [home[0]["expert_bytes_r0"] // 2] * 4, received
    # One node of 4 (EP 2 x DP 2), two TP-2 engines on GPUs 0-1 and 2-3: the same, engine 1
    # fed by the second replica of each EP rank.
    two = [r["files_ep2"][f"ep{engine_ep}_home1"] for r in results]
    assert results[0]["files_ep2"][f"ep{engine_ep}_home1_diff"] == [[], []]
    assert two[0]["writers"] == [{0: {0}, 1: {1}}, {0: {2}, 1: {3}}], two[0]["writers"]
    assert all(h["verified"] and h["versions"] == ["1", "1"] for h in two)
    assert [h["received"] for h in two] == received
