"""Weight sync on CPU, phase by phase, against a memcpy of the same bytes in the same run, plus
a projection for Qwen3-30B-A3B and Qwen3-235B-A22B (docs/performance.md).

    python benchmarks/weight_sync.py                       # small: ~100 MB fp32 MoE, EP=2
    python benchmarks/weight_sync.py --layout tp2
    python benchmarks/weight_sync.py --size 2gb            # >= 2 GB (needs an idle machine)
    python benchmarks/weight_sync.py --engine sglang       # into the real SGLang CPU server

Two gloo ranks build a Qwen3-MoE-shaped model locally; rank 0 (the sender) pushes it to an
in-process engine that decodes every payload exactly as SGLang's server does (its allow-list
unpickler on `FlattenedTensorBucket` payloads; SGLang's own group code in a receiver process
for `distributed`; safetensors for `disk`) and times its side; with `--engine sglang` to the
real SGLang 0.5.23 CPU server (engine venv) instead, in bf16, whose side is inside `xfer`
(tensor, distributed: decode, load, store) or `finish` (disk: the reload), and its hashing
inside `verify`. Rows:

  export       drain `bridge.export_hf_weights` (TP/EP all-gathers, PP broadcasts), keep nothing
  export->r0   the same with experts gathered to EP rank 0 only, one gather per expert tensor
  export bat   the same with the expert gathers batched per bucket (what the sync uses)
  export own   each rank's own tensors, no expert gathered (what an owners sender walks): the
               bridge's walk of every HF tensor (rank 0's row)
  export grp   the same with the experts straight from the Megatron parameters
               (`weights.grouped_export=auto`): the bridge walks only the other tensors
  tensor       export + buckets -> engine, no verification, export and send overlapped
               (`weights.layout` auto: SGLang's own layout with the tensor transport)
  tensor hf    (real server only) the same in HF names, one sender: the path before issue 36
  owners       (real server only) `weights.senders=owners`: every rank sends its shard
  owners hf    (real server only) the same in HF names
  tensor brx   tensor with `weights.grouped_export=off`: the experts from the bridge's walk of
               every expert HF tensor (the path before), not straight from the Megatron
               parameters
  owners brx   (real server only) owners with `weights.grouped_export=off`
  tensor seq   the same with `weights.overlap=false` (export, then send, bucket after bucket)
  tensor ptg   tensor with `weights.batch_expert_gathers=false` (the bridge's gather per expert)
  tensor+ver   tensor with verification (sender sha256 per bucket on the send thread, engine
               hashes what it holds, compare)
  tensor fp8   export + block FP8 quantise (+ per-bucket e4m3 bound check) + tensor
  distributed  export + gloo broadcast of flattened buckets to a receiver process (which
               ships the tensors back to the test engine through a pipe: its `xfer` is inflated)
  disk         export + safetensors shards + config, engine reloads them

`coll`: torch.distributed collectives rank 0 issued during the push (gathers, broadcasts).
Phase columns (seconds on the sender; overlapped phases add up to more than `wall`):
  export   waiting on the bridge (gathers, merges)      convert  cast / quantise / FP8 check
  cksum    sender sha256 (send thread)                  ser      build the SGLang payload
  load     engine side: decode + store / read files     xfer     send - ser - load (rest of the
  drain    waiting for the last send                             transport: broadcast, writes)
  fin      end session / write config / reload          verify   engine hash + compare
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_gspo.testing.harness import spawn_ranks  # noqa: E402
from megatron_gspo.weights import fp8  # noqa: E402

LAYOUTS = {"ep2": dict(ep=2), "tp2": dict(tp=2), "pp2": dict(pp=2)}
SIZES = {  # hidden, layers, experts, moe_intermediate (fp32 bytes ~ 4 x params)
    "small": dict(hidden=512, layers=4, experts=8, moe=256),  # ~0.1 GB
    "medium": dict(hidden=1024, layers=4, experts=8, moe=512),  # same tensor count, ~4x bytes
    "2gb": dict(hidden=1024, layers=6, experts=64, moe=512),  # ~2.5 GB
}
PHASES = ("export", "convert", "checksum", "ser", "load", "xfer", "drain", "finish", "verify")


def save_bench_model(out: Path, size: str) -> Path:
    """The tiny Qwen3-MoE of `SIZES[size]` as an HF checkpoint in `out` (seed 0)."""
    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

    dims = SIZES[size]
    return save_tiny_hf_checkpoint(
        out,
        seed=0,
        hidden_size=dims["hidden"],
        num_hidden_layers=dims["layers"],
        num_experts=dims["experts"],
        moe_intermediate_size=dims["moe"],
        intermediate_size=dims["hidden"] * 2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=dims["hidden"] // 8,
        vocab_size=8192,
    )


def _memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # touch pages first: measure copying, not page faults
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / 1e9 / best


def _timing_engine(name: str) -> Any:
    """`FakeEngine` (one TP rank) that times its own side: payload build, decode, checksums."""
    from megatron_gspo.engines.wire import deserialize_named_tensors, serialize_flattened_bucket
    from tests.weights.fake_engine import FakeEngine

    class TimingEngine(FakeEngine):
        def __init__(self) -> None:
            super().__init__(name, tp_size=1)
            self.seconds: dict[str, float] = {}

        def _add(self, phase: str, t0: float) -> float:
            t = time.perf_counter()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + t - t0
            return t

        def update_weights_from_tensor(self, named, *, weight_version=None, flush_cache=True):
            self._need_session("update_weights_from_tensor")
            t = time.perf_counter()
            payloads, _keep = serialize_flattened_bucket(list(named), tp_size=1)
            t = self._add("ser", t)
            self._store(deserialize_named_tensors(payloads[0]))
            self._add("load", t)
            self._set_version(weight_version)

        def update_weights_from_disk(self, path, *, weight_version=None):
            t = time.perf_counter()
            super().update_weights_from_disk(path, weight_version=weight_version)
            self._add("load", t)

        def weights_checksum(self):
            t = time.perf_counter()
            out = super().weights_checksum()
            self._add("engine_hash", t)
            return out

    return TimingEngine()


def _sglang_client(urls: list[str]) -> Any:
    """A client of the real SGLang server(s) at `urls` (its side is not timed apart: its
    decode, load and store are inside the sender's `send`, its hashing inside `verify`)."""
    from megatron_gspo.engines.client import ClientConfig, SGLangClient

    return SGLangClient(ClientConfig(engine_urls=urls))


_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "gather", "broadcast", "all_reduce",
                "all_gather_object", "broadcast_object_list", "gather_object")  # fmt: skip


class CountCollectives:
    """Counts torch.distributed collectives issued by this process while active (the bridge's
    gathers, the batched expert gathers, the weight-update broadcasts, object broadcasts)."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> CountCollectives:
        dist = torch.distributed
        for name in _COLLECTIVES:
            fn = getattr(dist, name)
            self._saved[name] = fn

            def counted(*a: Any, _fn: Any = fn, **k: Any) -> Any:
                self.count += 1
                return _fn(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self._saved.items():
            setattr(torch.distributed, name, fn)


def build_rank_model(hf_dir: str, layout: dict) -> tuple[Any, Any]:
    """This rank's `(bridge, model)` of the HF checkpoint `hf_dir` in `layout` (Layout fields),
    one torch thread (two ranks share the 2-core machine)."""
    torch.set_num_threads(1)
    from megatron_gspo.megatron.model import (
        Layout,
        build_model,
        init_megatron,
        load_bridge,
        make_provider,
        quiet_megatron,
    )

    quiet_megatron()
    bridge = load_bridge(hf_dir)
    init_megatron(Layout(**layout))
    return bridge, build_model(make_provider(bridge, Layout(**layout)), load_from=bridge)


def rank_main(
    rank: int,
    world: int,
    hf_dir: str,
    tmp: str,
    layout: dict,
    mb: float,
    repeats: int,
    only: list[str] | None = None,
    engine_urls: list[str] | None = None,
) -> Any:
    from megatron_gspo.patches.bridge import ep_local_experts
    from megatron_gspo.weights.grouped import local_export
    from megatron_gspo.weights.stream import hf_tensors
    from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig

    bridge, model = build_rank_model(hf_dir, layout)
    rows: dict[str, dict[str, Any]] = {}

    # Warm-up pass (first-call costs of the bridge, allocator), then the measured export.
    for _ in bridge.export_hf_weights(model, cpu=True, show_progress=False):
        pass

    def own(grouped: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's own tensors, no expert gathered (what each owners sender walks): the
        bridge's walk of every HF tensor, or (grouped) the experts from the parameters."""
        with ep_local_experts() as local:
            for name, t in local_export(bridge, model, local, grouped=grouped):
                local.pop(name, None)
                yield name, t

    exports = {
        "export": lambda: hf_tensors(bridge, model, cpu=True, experts_to_first=False),
        "export->r0": lambda: hf_tensors(bridge, model, cpu=True),
        "export bat": lambda: hf_tensors(
            bridge, model, cpu=True, expert_batch_bytes=int(mb * 2**20)
        ),
        "export own": lambda: own(False),
        "export grp": lambda: own(True),
    }
    for label, exported in exports.items():
        for _ in range(repeats):  # the fastest of `repeats` (the machine is shared)
            torch.distributed.barrier()
            t = time.perf_counter()
            nbytes = ntensors = 0
            with CountCollectives() as counted:
                for _, tensor in exported():
                    nbytes += tensor.numel() * tensor.element_size()
                    ntensors += 1
            wall = time.perf_counter() - t
            if label not in rows or wall < rows[label]["wall"]:
                rows[label] = dict(
                    wall=wall,
                    bytes=nbytes,
                    buckets=0,
                    tensors=ntensors,
                    phases={},
                    collectives=counted.count,
                )

    cases = {
        "tensor": dict(transport="tensor", verify_every=0),
        "tensor seq": dict(transport="tensor", verify_every=0, overlap=False),
        "tensor ptg": dict(transport="tensor", verify_every=0, batch_expert_gathers=False),
        "tensor brx": dict(transport="tensor", verify_every=0, grouped_export="off"),
        "tensor+ver": dict(transport="tensor", verify_every=1),
        "tensor fp8": dict(transport="tensor", fp8=True, verify_every=0),
        "distributed": dict(transport="distributed", verify_every=0),
        "disk": dict(transport="disk", disk_dir=str(Path(tmp) / "disk"), verify_every=0),
    }
    if engine_urls:  # the real server: bf16 (what it serves), its own group for distributed
        cases = {k: dict(v, dtype="bfloat16") for k, v in cases.items() if k != "tensor fp8"}
        cases["distributed"]["backend"] = "gloo"
        # `tensor` is SGLang's layout from one sender (auto); against HF names from one sender
        # (the path before issue 36) and every rank sending its shard (each rank its client).
        tensor = cases["tensor"]
        cases["tensor hf"] = dict(tensor, layout="hf")
        cases["owners"] = dict(tensor, senders="owners")
        cases["owners hf"] = dict(tensor, senders="owners", layout="hf")
        cases["owners brx"] = dict(tensor, senders="owners", grouped_export="off")
        # the experts gathered to one holder per engine rank first (verified pushes do this)
        cases["owners gth"] = dict(tensor, senders="owners", expert_slices="off")
    if only:  # --rows: the sync rows asked for (the export rows always run)
        cases = {k: v for k, v in cases.items() if k in only}
    nbytes_sent = rows["export->r0"]["bytes"]
    memcpy = _memcpy_gbps(nbytes_sent) if rank == 0 else 0.0
    for name, cfg in cases.items():
        if rank == 0:  # the best memcpy of the run: the ratios are never flattered by a slow one
            memcpy = max(memcpy, _memcpy_gbps(nbytes_sent))
        engine: Any = None
        owners = cfg.get("senders") == "owners"
        client = _sglang_client(engine_urls) if engine_urls and (rank == 0 or owners) else None
        if rank == 0:
            engine = client or _timing_engine(name)
        sync = WeightSync(
            bridge,
            [engine] if engine else [],
            WeightSyncConfig(bucket_mb=mb, **cfg),
            send_engines=[client] if owners and client else None,
        )
        sync.push(model)  # warm-up (and group setup for the distributed transport)
        best = None
        for _ in range(repeats):  # the fastest of `repeats` (the machine is shared)
            if engine is not None and hasattr(engine, "seconds"):
                engine.seconds.clear()
            torch.distributed.barrier()
            t = time.perf_counter()
            with CountCollectives() as counted:
                report = sync.push(model)
            wall = time.perf_counter() - t
            if best is None or wall < best[0]:
                seconds = dict(getattr(engine, "seconds", {}))
                best = (wall, report, seconds, counted.count)
        sync.close()
        if client is not None:
            client.close()
        if engine is None:
            continue
        wall, report, engine_seconds, n_coll = best
        phases = dict(report.stats.seconds)
        phases.update(engine_seconds)
        if name == "distributed":  # the receiver process decodes while the broadcast runs
            phases.setdefault("load", 0.0)
        phases["xfer"] = max(
            0.0, phases.get("send", 0.0) - phases.get("ser", 0.0) - phases.get("load", 0.0)
        )
        rows[name] = dict(
            wall=wall,
            bytes=report.stats.bytes_sent,
            buckets=report.stats.buckets,
            tensors=report.stats.tensors,
            phases=phases,
            collectives=n_coll,
            # HF tensors the bridge walked over all ranks (owners: every sender's export)
            walked=report.stats.tensors_seen - report.stats.direct_experts,
            direct=report.stats.direct_experts,
        )
    if engine_urls and (not only or "floor" in only):
        norm = [  # the export is collective: every rank walks all of it
            t.to(torch.bfloat16).clone()
            for n, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)
            if n == "model.norm.weight"
        ][0]
        if rank == 0:
            rows["floor"] = _floor(bridge, norm, engine_urls, repeats)
    if rank != 0:
        return None
    return {"rows": rows, "memcpy": max(memcpy, _memcpy_gbps(nbytes_sent))}


def _floor(bridge: Any, norm: torch.Tensor, engine_urls: list[str], repeats: int) -> dict:
    """What every push into the real server pays whatever it sends: a weight-update session
    (begin, one `direct` request of one small tensor, end, the version stamp), one sender."""
    from megatron_gspo.engines.weight_shards import EngineLayout
    from megatron_gspo.weights import hf_io

    lay = EngineLayout.of(hf_io.hf_config_of(bridge), 1)
    client = _sglang_client(engine_urls)
    best = float("inf")
    for i in range(repeats + 1):  # the first: warm-up
        t = time.perf_counter()
        with client.weight_update_session(f"floor-{i}"):
            client.update_weights_from_tensor([("model.norm.weight", norm)], layout=lay)
        best = min(best, time.perf_counter() - t) if i else best
    client.close()
    nbytes = norm.numel() * norm.element_size()
    return dict(wall=best, bytes=nbytes, buckets=1, tensors=1, phases={}, collectives=0)


def qwen3_moe_hf_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF checkpoint name, shape) of every tensor of a Qwen3-MoE checkpoint (per-expert names)."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, i_moe = (
        cfg["num_attention_heads"] * hd,
        cfg["num_key_value_heads"] * hd,
        cfg["moe_intermediate_size"],
    )
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate.weight", (cfg["num_experts"], h)),
        ]
        for e in range(cfg["num_experts"]):
            out += [
                (p + f"mlp.experts.{e}.gate_proj.weight", (i_moe, h)),
                (p + f"mlp.experts.{e}.up_proj.weight", (i_moe, h)),
                (p + f"mlp.experts.{e}.down_proj.weight", (h, i_moe)),
            ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg["vocab_size"], h))]
    return out


QWEN3 = {
    "Qwen3-30B-A3B": dict(  # config.json of Qwen/Qwen3-30B-A3B
        vocab_size=151936, hidden_size=2048, head_dim=128, num_attention_heads=32,
        num_key_value_heads=4, moe_intermediate_size=768, num_hidden_layers=48, num_experts=128,
    ),
    "Qwen3-235B-A22B": dict(  # config.json of Qwen/Qwen3-235B-A22B
        vocab_size=151936, hidden_size=4096, head_dim=128, num_attention_heads=64,
        num_key_value_heads=4, moe_intermediate_size=1536, num_hidden_layers=94, num_experts=128,
    ),
}  # fmt: skip


def estimate(cfg: dict, bucket_bytes: int, use_fp8: bool) -> dict[str, int]:
    """Tensors exported, tensors / bytes sent and buckets for a Qwen3-MoE in bf16 or block FP8,
    plus the export's collectives per rank (one per HF tensor; the bridge gathers per tensor)."""
    shapes = qwen3_moe_hf_shapes(cfg)
    sizes = []
    for name, shape in shapes:
        n = math.prod(shape)
        if use_fp8 and fp8.is_quantised_name(name) and len(shape) == 2:
            sizes += [n, 4 * math.prod(fp8.scale_shape(shape))]
        else:
            sizes.append(2 * n)
    buckets, cur = 0, 0
    for s in sizes:  # the same greedy packing as stream.iter_buckets
        if cur and cur + s > bucket_bytes:
            buckets, cur = buckets + 1, 0
        cur += s
    experts = sum(".experts." in n for n, _ in shapes)
    return dict(
        hf_tensors=len(shapes),
        expert_tensors=experts,
        sent=len(sizes),
        bytes=sum(sizes),
        buckets=buckets + (cur > 0),
    )


def _fmt(x: float) -> str:
    return f"{x:7.3f}" if x < 100 else f"{x:7.1f}"


def _verification_line(rows: dict[str, dict[str, Any]]) -> None:
    """Verification's cost, counted as if nothing overlapped: the sender's sha256 (on the send
    thread) plus the verify step (engine hashes + compare), against the fastest unverified
    push; and the smallest `weights.verify_every` that keeps it <= 10% of sync time on average
    (one verified push in N costs cost / N per push)."""
    base = min(rows["tensor"]["wall"], rows["tensor seq"]["wall"])
    ver = rows["tensor+ver"]["phases"]
    cost = ver.get("checksum", 0.0) + ver.get("verify", 0.0)
    n_default = max(1, math.ceil(cost / (0.1 * base)))
    print(
        f"verification: {cost:.3f} s = sender sha256 {ver.get('checksum', 0):.3f} s (send "
        f"thread) + verify step {ver.get('verify', 0):.3f} s (engine hash "
        f"{ver.get('engine_hash', 0):.3f} s + compare) = {100 * cost / base:.0f}% of a "
        f"{base:.3f} s push -> verify_every >= {n_default} keeps it <= 10% of a sync"
    )


@contextlib.contextmanager
def _sglang_server(hf_dir: str, tmp: str) -> Iterator[list[str]]:
    """The real SGLang CPU server serving `hf_dir` (bf16) while active; yields its URLs."""
    from megatron_gspo.dist import free_port
    from megatron_gspo.engines.launch import ServerGroup
    from megatron_gspo.testing import sglang_server

    python = sglang_server.engine_python()
    if python is None:
        raise SystemExit("no SGLang engine venv: run `bash scripts/engine_env.sh` first")
    cfg = sglang_server.cpu_launch_config(
        hf_dir,
        python=python,
        log_dir=str(Path(tmp) / "server"),
        base_port=free_port(),
        startup_timeout_s=900.0,  # a shared 2-core machine: minutes
    )
    group = ServerGroup(cfg)
    t = time.perf_counter()
    group.start()
    print(f"real SGLang CPU server ready in {time.perf_counter() - t:.0f} s", flush=True)
    try:
        yield list(cfg.engine_urls)
    finally:
        group.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="ep2", choices=sorted(LAYOUTS))
    ap.add_argument("--size", default="small", choices=sorted(SIZES), help="model preset")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3, help="measured pushes per row (fastest)")
    ap.add_argument(
        "--engine",
        default="test",
        choices=("test", "sglang"),
        help="test: the in-process engine that decodes with SGLang's code (times its side); "
        "sglang: the real SGLang CPU server (engine venv, bf16; rows without fp8)",
    )
    ap.add_argument(
        "--rows",
        default="",
        help="comma-separated sync rows to run (default: all), e.g. "
        "'tensor,tensor seq,tensor+ver' for the verification line",
    )
    args = ap.parse_args()
    size = SIZES[args.size]

    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mgspo-bench-") as tmp, contextlib.ExitStack() as stack:
        hf = save_bench_model(Path(tmp) / "hf", args.size)
        urls = None
        if args.engine == "sglang":
            urls = stack.enter_context(_sglang_server(str(hf), tmp))
        t = time.perf_counter()
        res = spawn_ranks(
            rank_main,
            2,
            str(hf),
            tmp,
            LAYOUTS[args.layout],
            args.bucket_mb,
            args.repeats,
            [r.strip() for r in args.rows.split(",") if r.strip()] or None,
            urls,
        )[0]
        wall = time.perf_counter() - t
    memcpy = res["memcpy"]
    rows = res["rows"]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(
        f"\nweight sync on CPU into the {args.engine} engine: {args.layout}, size {args.size} "
        f"({size}), 2 gloo ranks x 1 "
        f"thread, fp32 model, bucket {args.bucket_mb:g} MiB, fastest of {args.repeats}, run wall "
        f"{wall:.0f} s\n"
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; at end: {uptime}"
    )
    head = " ".join(f"{p[:7]:>7}" for p in PHASES)
    print(
        f"{'path':<12} {'MB':>7} {'tensors':>7} {'bkts':>5} {'coll':>5} {head} {'wall':>7} "
        f"{'GB/s':>6} {'xmemcpy':>7}"
    )
    for name, r in rows.items():
        gbps = r["bytes"] / 1e9 / r["wall"]
        cells = " ".join(_fmt(r["phases"][p]) if p in r["phases"] else f"{'-':>7}" for p in PHASES)
        if name.startswith("export"):
            cells = _fmt(r["wall"]) + " " + " ".join(f"{'-':>7}" for _ in PHASES[1:])
        print(
            f"{name:<12} {r['bytes'] / 1e6:7.1f} {r['tensors']:7d} {r['buckets']:5d} "
            f"{r['collectives']:5d} {cells} "
            f"{r['wall']:7.3f} {gbps:6.3f} {gbps / memcpy:7.3f}"
        )
    print(f"{'memcpy':<12} {rows['export->r0']['bytes'] / 1e6:7.1f} {'':>7} {'':>5} {'':>5} "
          f"{'':>{8 * len(PHASES) - 1}} {'':>7} {memcpy:6.2f} {1.0:7.3f}")  # fmt: skip

    walked = [f"{n} {r['walked']} (+{r['direct']})" for n, r in rows.items() if "walked" in r]
    print("HF tensors the bridge walked per push, all ranks (+ experts taken straight from the "
          "Megatron parameters): " + "; ".join(walked))  # fmt: skip
    per_tensor_ms = 1e3 * rows["export bat"]["wall"] / rows["export bat"]["tensors"]
    print(
        f"\nexport (batched) per HF tensor: {per_tensor_ms:.2f} ms "
        f"({rows['export bat']['tensors']} tensors)"
    )
    if {"tensor", "tensor seq", "tensor+ver"} <= set(rows):
        _verification_line(rows)

    print("\nQwen3 projection inputs (bf16 / block FP8, 512 MiB buckets):")
    print(f"{'model':<16} {'fmt':<5} {'HF tensors':>10} {'expert':>7} {'sent':>7} {'GB':>7} "
          f"{'buckets':>7}")  # fmt: skip
    for model, cfg in QWEN3.items():
        for use_fp8 in (False, True):
            e = estimate(cfg, 512 * 1024**2, use_fp8)
            print(
                f"{model:<16} {'fp8' if use_fp8 else 'bf16':<5} {e['hf_tensors']:10d} "
                f"{e['expert_tensors']:7d} {e['sent']:7d} {e['bytes'] / 1e9:7.2f} "
                f"{e['buckets']:7d}"
            )


if __name__ == "__main__":
    main()
