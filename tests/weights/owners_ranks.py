"""Rank program of tests/weights/test_owners.py: `weights.senders=owners` against today's path.

Four gloo ranks, the tiny MoE, real embedded engines (SGLang's HTTP app over an HF model, fed
by `update_weights_from_tensor` shared-memory payloads from whichever process sends), one
scenario per (layout, nodes):

* `ep4`: one node, EP=4: today's push (`senders=one`) and the owners push, each into an engine
  reset to another checkpoint first; every rank counts the bytes it received over collectives
  and the bytes it sent to engines.
* `ep2_2nodes`: two "nodes" of two ranks (GROUP_RANK / LOCAL_WORLD_SIZE as torchrun sets them
  on two hosts), EP=2 inside each node, one engine per node started by the node's local rank
  0; every rank sends through a client that records which engine it wrote to.

Rank 0 returns small summaries (names that differ, counts), never tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.engines.client import ClientConfig, SGLangClient
from megatron_gspo.engines.weight_layout import engine_layout, rank_pieces
from megatron_gspo.engines.wire import (
    deserialize_named_tensors,
    direct_payloads_from_pieces,
    tensor_checksum,
)
from megatron_gspo.layout import Layout
from megatron_gspo.megatron.model import (
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.testing.weights import hf_state
from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
from tests.weights.fake_engine import FakeEngine
from tests.weights.grouped_ranks import grouped_vs_bridge

BUCKET_MB = 64 / 1024  # 64 KiB: several buckets per sender
PATHS: dict[str, dict[str, Any]] = {
    # the reference: rank 0 sends SGLang's layout, the experts from the bridge's export
    "one": {"senders": "one", "grouped_export": "off"},
    "one_grouped": {"senders": "one"},  # the same, experts from the Megatron parameters
    "owners_hf": {"senders": "owners", "layout": "hf"},  # every rank, HF names (before)
    "owners": {"senders": "owners"},  # every rank, SGLang's own layout (auto: grouped)
    # the same unverified: each EP rank sends its experts as slices (weights.expert_slices)
    "owners_slices": {"senders": "owners", "verify_every": 0},
}


class RecordingClient(SGLangClient):
    """An `SGLangClient` that records the engines and bytes of every tensor payload it posts."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.sent: list[tuple[str, int, list[str]]] = []

    def update_weights_from_tensor(self, named_tensors: Any, **kw: Any) -> None:
        nbytes = sum(t.numel() * t.element_size() for _, t in named_tensors)
        names = [n for n, _ in named_tensors]
        if kw.get("layout") is not None:  # the names a one-rank engine loads (slices named)
            pieces = rank_pieces(named_tensors, 0, engine_layout(kw["layout"], 1))
            names = [p.name for p in pieces]
        for url in self.config.engine_urls:
            self.sent.append((url, nbytes, names))
        super().update_weights_from_tensor(named_tensors, **kw)


class RankFilesEngine(FakeEngine):
    """A TP-`tp` engine in SGLang's own layout whose ranks are files: every rank's process
    holds one of these on the same directory, so what any sender writes is what the engine
    holds. Each call's payload goes through SGLang's own `direct` wire (one buffer per rank,
    its allow-list unpickler) and every rank's tensors are stored as that rank decoded them;
    `weights_checksum` answers as SGLang's `/weights_checker` does (per rank, fused names,
    SGLang's hash of what the rank holds)."""

    def __init__(
        self, root: Path, tp: int, gpus: list[int] | None = None, engine_id: str = "files"
    ) -> None:
        super().__init__(engine_id, tp_size=tp)
        self.root = root
        self.engine_gpu_ids = None if gpus is None else [gpus]
        """The GPU of each rank ("on GPUs 0-1"): the colocated home path feeds rank r from
        the trainer rank of local rank gpus[r]; None: unknown (the per-parameter senders)."""
        self.sent_bytes = 0
        self.tensors = 0
        self.corrupt: tuple[int, str] | None = None

    def begin_weight_update(self) -> None:
        (self.root / "session").touch(exist_ok=False)  # a second begin fails, as in SGLang

    def end_weight_update(self) -> None:
        (self.root / "session").unlink(missing_ok=True)

    def update_weights_from_tensor(
        self, named_tensors, *, weight_version=None, flush_cache=True, layout=None
    ):
        assert layout is not None, "this engine takes SGLang's own layout only"
        assert (self.root / "session").exists(), "update outside a weight-update session"
        lay = engine_layout(layout, self.tp_size)
        for r in range(self.tp_size):
            pieces = rank_pieces(named_tensors, r, lay)
            payload, _keep = direct_payloads_from_pieces([pieces])
            got = deserialize_named_tensors(payload[0], "direct")
            with open(self.root / f"from{torch.distributed.get_rank()}", "a") as log:
                log.writelines(f"{r} {name}\n" for name, _ in got)  # who wrote what where
            for name, t in got:
                (self.root / f"r{r}").mkdir(exist_ok=True)
                t = t.clone()
                if (r, name) == self.corrupt:
                    t.view(-1)[0] += 1  # a silent bit error on one engine rank
                torch.save(t, self.root / f"r{r}" / name)
                self.sent_bytes += t.numel() * t.element_size()
                self.tensors += 1

    def set_weight_version(self, weight_version: str) -> None:
        (self.root / "version").write_text(weight_version)

    def weight_version(self) -> dict[str, str]:
        return {self.engine_id: (self.root / "version").read_text()}

    def writers(self) -> dict[int, set[int]]:
        """{engine rank: trainer ranks that sent it a tensor}."""
        out: dict[int, set[int]] = {}
        for f in self.root.glob("from*"):
            for line in f.read_text().splitlines():
                out.setdefault(int(line.split()[0]), set()).add(int(f.name[4:]))
        return out

    def held(self) -> dict[str, torch.Tensor]:
        """`{"r<rank>/<sglang name>": tensor}` of every rank."""
        return {
            f"{f.parent.name}/{f.name}": torch.load(f, weights_only=True)
            for f in sorted(self.root.glob("r*/*"))
        }

    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        ranks = [{} for _ in range(self.tp_size)]
        for key, t in self.held().items():
            r, name = key.split("/", 1)
            ranks[int(r[1:])][name] = tensor_checksum(t)
        return {self.engine_id: {"ranks": [{"checksums": c, "tp_rank": i} for i, c in
                                           enumerate(ranks)]}}  # fmt: skip

    def engine_tp_sizes(self) -> list[int]:
        return [self.tp_size]


class CollectiveBytes:
    """Bytes this rank RECEIVES through tensor collectives while active (gather on the
    destination, all_gather, broadcast on the receivers)."""

    NAMES = ("gather", "all_gather", "all_gather_into_tensor", "broadcast", "recv")

    def __init__(self) -> None:
        self.received = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CollectiveBytes:
        d = torch.distributed
        me = d.get_rank()

        def size(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def wrap(name: str) -> Any:
            fn = getattr(d, name)

            def counted(*args: Any, **kw: Any) -> Any:
                out = fn(*args, **kw)
                if name == "gather":
                    parts = kw.get("gather_list", args[1] if len(args) > 1 else None)
                    if parts:
                        self.received += sum(size(p) for p in parts) - size(args[0])
                elif name == "all_gather":
                    self.received += sum(size(p) for p in args[0]) - size(args[1])
                elif name == "all_gather_into_tensor":
                    self.received += size(args[0]) - size(args[1])
                elif name == "recv":  # point to point: SGLang's layout's expert gathers
                    self.received += size(args[0])
                else:
                    src = kw.get("src", args[1] if len(args) > 1 else 0)
                    group = kw.get("group")
                    gsrc = src if group is None else d.get_global_rank(group, src)
                    if gsrc != me:
                        self.received += size(args[0])
                return out

            return counted

        for name in self.NAMES:
            self._saved[name] = getattr(d, name)
            setattr(d, name, wrap(name))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(torch.distributed, name, fn)


def _engine_state(server: Any) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in server.policy.model.state_dict().items()}


def _diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = set(a) | set(b)
    return sorted(n for n in keys if n not in a or n not in b or not torch.equal(a[n], b[n]))


def scenario(
    rank: int, bridge: Any, other: str, layout: Layout, ranks_per_node: int
) -> dict[str, Any]:
    """Today's push, then the owners push, each into engines reset to `other`."""
    from megatron_gspo.engines.embedded.server import EmbeddedServer

    os.environ["GROUP_RANK"] = str(rank // ranks_per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    node = rank // ranks_per_node
    init_megatron(layout)
    model = build_model(make_provider(bridge, layout), load_from=bridge)
    ref = hf_state(bridge, model)
    total = sum(t.numel() * t.element_size() for t in ref.values())
    server = EmbeddedServer(other).start() if rank % ranks_per_node == 0 else None
    urls: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(urls, server.url if server else None)
    node_urls = [u for u in urls if u]
    every = SGLangClient(ClientConfig(engine_urls=node_urls)) if rank == 0 else None
    mine = RecordingClient(ClientConfig(engine_urls=[node_urls[node]]))
    out: dict[str, Any] = {"model_bytes": total, "node": node}
    out["grouped"] = grouped_vs_bridge(bridge, model, ref)
    for path, kw in PATHS.items():
        base = dict(transport="tensor", bucket_mb=BUCKET_MB, verify_every=1, verify_names="common")
        cfg = WeightSyncConfig(**{**base, **kw})
        sync = WeightSync(bridge, [every] if every else [], cfg, send_engines=[mine])
        info: dict[str, Any] = {}
        # owners in HF names: the first verified push learns the engines' naming through one
        # sender; the second (HF names: the embedded engine) is the push measured here.
        for push in (1, 2) if kw["senders"] == "owners" else (1,):
            if every is not None:
                every.update_weights_from_disk(other, weight_version="reset")
            torch.distributed.barrier()
            mine.sent.clear()
            with CollectiveBytes() as counted:
                report = sync.push(model)
            info = {
                "push": push,
                "version": report.version,
                "verified": report.verified,
                "received": counted.received,
                "sent": sync.local_stats.bytes_sent,
                "bytes_by_rank": report.bytes_by_rank,
                "tensors": report.stats.tensors,
                "records": [(u, n, names) for u, n, names in mine.sent],
                "direct": sync.local_stats.direct_experts,
            }
        sync.close()
        if every is not None:
            info["engine_version"] = every.weight_version()
        if server is not None:
            info["state"] = _engine_state(server)
        out[path] = info
    if server is not None:
        one = out["one"].pop("state")
        for path in ("one_grouped", "owners_hf", "owners", "owners_slices"):
            got = out[path].pop("state")
            out[path]["engine_vs_today"] = _diff(one, got)
            # Every parameter the engine holds under an exported name equals the export.
            out[path]["engine_vs_export"] = sorted(
                n for n in got if n in ref and not torch.equal(got[n], ref[n].to(got[n].dtype))
            )
        out["engine_params"] = len(one)
        out["engine_params_exported"] = sum(n in ref for n in one)
    mine.close()
    if every is not None:
        every.close()
    torch.distributed.barrier()
    if server is not None:
        server.stop()
    return out


def files_scenario(rank: int, bridge: Any, layout: Layout, tmp: str) -> dict[str, Any]:
    """Trainer `layout` on one node into a TP-2 engine in SGLang's own layout
    (`RankFilesEngine`), with engine EP 2 (each trainer EP rank builds its engine rank's
    experts) and engine EP 1 (each engine rank holds a slice of every expert: gathered per
    parameter); one sender, then every rank, into a fresh engine each."""
    os.environ["GROUP_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "4"
    init_megatron(layout)
    model = build_model(make_provider(bridge, layout), load_from=bridge)
    out: dict[str, Any] = {}
    for engine_ep in (2, 1):
        held: dict[str, dict[str, torch.Tensor]] = {}
        for senders in ("one", "owners"):
            root = Path(tmp) / f"files_{layout.ep}_{engine_ep}_{senders}"
            if rank == 0:
                root.mkdir()
            torch.distributed.barrier()
            engine = RankFilesEngine(root, tp=2)
            cfg = WeightSyncConfig(
                transport="tensor",
                senders=senders,
                bucket_mb=BUCKET_MB,
                verify_every=1,
                engine_ep_size=engine_ep,
                # the reference: the bridge's experts; owners: the Megatron parameters (auto)
                grouped_export="off" if senders == "one" else "auto",
            )
            sync = WeightSync(bridge, [engine] if rank == 0 else [], cfg, send_engines=[engine])
            with CollectiveBytes() as counted:
                report = sync.push(model)
            sync.close()
            torch.distributed.barrier()
            out[f"ep{engine_ep}_{senders}"] = {
                "verified": report.verified,
                "version": engine.weight_version()["files"],
                "received": counted.received,
                "sent": sync.local_stats.bytes_sent,
                "engine_tensors": engine.tensors,
                "direct": sync.local_stats.direct_experts,
            }
            if rank == 0:
                held[senders] = engine.held()
            if senders == "owners" and engine_ep == 2:
                # A later push (namings now known) with one engine rank's expert parameter
                # corrupted on arrival: rank 0's comparison with the senders' hashes names it.
                engine.corrupt = (1, "model.layers.1.mlp.experts.w2_weight")
                try:
                    sync.push(model)
                    out["corrupt_caught"] = ""
                except Exception as e:  # noqa: BLE001 - the expected failure, recorded
                    out["corrupt_caught"] = f"{type(e).__name__}: {e}"
                sync.close()
        home = home_scenario(rank, bridge, model, Path(tmp) / f"home_{engine_ep}", engine_ep)
        out[f"ep{engine_ep}_home"] = home
        two = Path(tmp) / f"home1_{engine_ep}"
        out[f"ep{engine_ep}_home1"] = home_scenario(
            rank, bridge, model, two, engine_ep, one_node=True
        )
        if rank == 0:
            one, owners = held["one"], held["owners"]
            out[f"ep{engine_ep}_diff"] = _diff(one, owners)
            out[f"ep{engine_ep}_params"] = len(one)
            out[f"ep{engine_ep}_home_diff"] = [_diff(one, h) for h in home.pop("held")]
            two_engines = out[f"ep{engine_ep}_home1"].pop("held")
            out[f"ep{engine_ep}_home1_diff"] = [_diff(one, h) for h in two_engines]
    return out


def home_scenario(
    rank: int, bridge: Any, model: Any, root: Path, engine_ep: int, *, one_node: bool = False
) -> dict[str, Any]:
    """The colocated home path: two "nodes" of 2 ranks (trainer EP 2 in each), each with one
    TP-2 `RankFilesEngine` "on GPUs 0-1" (the engine ranks share the GPUs of local ranks 0
    and 1); every rank pushes its node's engine. `one_node`: one node of 4 ranks (trainer EP 2
    x DP 2) with two TP-2 engines, on GPUs 0-1 and 2-3 (as the recipe's four per node).
    Returns who wrote each engine rank."""
    saved = {k: os.environ[k] for k in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    per = 4 if one_node else 2
    os.environ.update(
        GROUP_RANK=str(rank // per), LOCAL_WORLD_SIZE=str(per), LOCAL_RANK=str(rank % per)
    )
    roots = [root / f"engine{n}" for n in (0, 1)]
    if rank == 0:
        for r in roots:
            r.mkdir(parents=True)
    torch.distributed.barrier()
    gpus = [[0, 1], [2, 3]] if one_node else [[0, 1], [0, 1]]
    engines = [RankFilesEngine(r, tp=2, gpus=g) for r, g in zip(roots, gpus, strict=True)]
    mine = engines if one_node else [engines[rank // 2]]
    cfg = WeightSyncConfig(
        transport="tensor",
        senders="owners",
        bucket_mb=BUCKET_MB,
        verify_every=1,
        engine_ep_size=engine_ep,
    )
    sync = WeightSync(bridge, engines if rank == 0 else [], cfg, send_engines=mine)
    try:
        with CollectiveBytes() as counted:
            report = sync.push(model)
    finally:
        sync.close()
        os.environ.update(saved)
    torch.distributed.barrier()
    out: dict[str, Any] = {
        "verified": report.verified,
        "versions": [e.weight_version()["files"] for e in engines],
        "received": counted.received,
        "sent": sync.local_stats.bytes_sent,
        "writers": [e.writers() for e in engines],
        "direct": sync.local_stats.direct_experts,
    }
    if rank == 0:
        out["held"] = [e.held() for e in engines]
        out["expert_bytes_r0"] = sum(
            t.numel() * t.element_size()
            for k, t in out["held"][0].items()
            if k.startswith("r0/") and ".experts." in k
        )
    return out


def main(rank: int, world: int, hf_dir: str, tmp: str) -> dict[str, Any]:
    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

    quiet_megatron()
    bridge = load_bridge(hf_dir)
    other = str(Path(tmp) / "hf_other")
    if rank == 0:
        save_tiny_hf_checkpoint(Path(other), seed=7)
    torch.distributed.barrier()
    return {
        "rank": rank,
        "ep4": scenario(rank, bridge, other, Layout(ep=4), ranks_per_node=4),
        "ep2_2nodes": scenario(rank, bridge, other, Layout(ep=2), ranks_per_node=2),
        "files_ep2": files_scenario(rank, bridge, Layout(ep=2), tmp),
    }
