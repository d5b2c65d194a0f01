"""Weight sync throughput on CPU (export + transport) against a plain memcpy, plus an estimate for
Qwen3-30B-A3B.

    python benchmarks/weight_sync.py                      # 2 gloo ranks, EP=2, ~90 MB fp32 MoE
    python benchmarks/weight_sync.py --layout tp2 --hidden 768

Measured on rank 0 (the sender) of a 2-rank job, on a Qwen3-MoE-shaped model built locally:
  export      drain `bridge.export_hf_weights` (TP/EP all-gathers, PP broadcasts), keep nothing
  export->r0  the same with experts gathered to EP rank 0 only (what the sync uses)
  tensor      export + buckets -> engine (SGLang FlattenedTensorBucket + serializer, decoded by
              SGLang's allow-list unpickler in a fake engine), no checksums
  tensor+sum  the same with per-tensor sha256 checksums on both sides (integrity check)
  tensor fp8  export + block FP8 quantise (+ bound check) + tensor transport
  distributed export + gloo broadcast of flattened buckets to a receiver process running
              SGLang's own group/receive code
  disk        export + safetensors shards + config, engine reloads them
  memcpy      one `dst.copy_(src)` of the same number of bytes as sent (the baseline)
GB/s = bytes sent / wall time; "x memcpy" = that rate / the memcpy rate of the same run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_gspo.testing.harness import spawn_ranks  # noqa: E402
from megatron_gspo.weights import fp8  # noqa: E402

LAYOUTS = {"ep2": dict(ep=2), "tp2": dict(tp=2), "pp2": dict(pp=2)}


def _memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)  # touch pages first: measure copying, not page faults
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / 1e9 / best


def rank_main(rank: int, world: int, hf_dir: str, tmp: str, layout: dict, mb: float) -> Any:
    from megatron_gspo.megatron.model import (
        Layout,
        build_model,
        init_megatron,
        load_bridge,
        make_provider,
        quiet_megatron,
    )
    from megatron_gspo.weights.stream import hf_tensors
    from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
    from tests.weights.fake_engine import FakeEngine

    quiet_megatron()
    bridge = load_bridge(hf_dir)
    init_megatron(Layout(**layout))
    model = build_model(make_provider(bridge, Layout(**layout)), load_from=bridge)
    rows: dict[str, tuple[float, int, int]] = {}

    # Warm-up pass (first-call costs of the bridge, allocator), then the measured export.
    for _ in bridge.export_hf_weights(model, cpu=True, show_progress=False):
        pass
    for label, to_first in (("export", False), ("export->r0", True)):
        torch.distributed.barrier()
        t = time.perf_counter()
        nbytes = 0
        for _, tensor in hf_tensors(bridge, model, cpu=True, experts_to_first=to_first):
            nbytes += tensor.numel() * tensor.element_size()
        rows[label] = (time.perf_counter() - t, nbytes, 0)

    cases = {
        "tensor": dict(transport="tensor", verify_every=0),
        "tensor+sum": dict(transport="tensor", verify_every=1),
        "tensor fp8": dict(transport="tensor", fp8=True, verify_every=0),
        "distributed": dict(transport="distributed", verify_every=0),
        "disk": dict(transport="disk", disk_dir=str(Path(tmp) / "disk"), verify_every=0),
    }
    for name, cfg in cases.items():
        engines = [FakeEngine(name)] if rank == 0 else []
        sync = WeightSync(bridge, engines, WeightSyncConfig(bucket_mb=mb, **cfg))
        sync.push(model)  # warm-up (and group setup for the distributed transport)
        torch.distributed.barrier()
        t = time.perf_counter()
        report = sync.push(model)
        rows[name] = (time.perf_counter() - t, report.stats.bytes_sent, report.stats.buckets)
        sync.close()
    if rank != 0:
        return None
    return {"rows": rows, "memcpy": _memcpy_gbps(rows["tensor"][1])}


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


QWEN3_30B_A3B = dict(  # config.json of Qwen/Qwen3-30B-A3B
    vocab_size=151936, hidden_size=2048, head_dim=128, num_attention_heads=32,
    num_key_value_heads=4, moe_intermediate_size=768, num_hidden_layers=48, num_experts=128,
)  # fmt: skip


def estimate(bucket_bytes: int, use_fp8: bool) -> tuple[int, int, int]:
    """(tensors sent, bytes, buckets) for Qwen3-30B-A3B in bf16 or block FP8."""
    sizes = []
    for name, shape in qwen3_moe_hf_shapes(QWEN3_30B_A3B):
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
    return len(sizes), sum(sizes), buckets + (cur > 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", default="ep2", choices=sorted(LAYOUTS))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=16.0, help="small: the model is ~100 MB")
    ap.add_argument(
        "--link-gbps",
        type=float,
        nargs="*",
        default=[25.0, 50.0, 100.0],
        help="link bandwidths (GB/s) for the Qwen3-30B-A3B estimate",
    )
    args = ap.parse_args()

    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

    with tempfile.TemporaryDirectory(prefix="mgspo-bench-") as tmp:
        hf = save_tiny_hf_checkpoint(
            Path(tmp) / "hf",
            seed=0,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_experts=args.experts,
            moe_intermediate_size=args.hidden // 2,
            intermediate_size=args.hidden * 2,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
            vocab_size=8192,
        )
        t = time.perf_counter()
        res = spawn_ranks(rank_main, 2, str(hf), tmp, LAYOUTS[args.layout], args.bucket_mb)[0]
        wall = time.perf_counter() - t
    memcpy = res["memcpy"]
    print(
        f"\nweight sync on CPU: {args.layout}, 2 gloo ranks, {torch.get_num_threads()} threads, "
        f"fp32 model, bucket {args.bucket_mb:g} MiB (run wall {wall:.0f} s incl. imports)"
    )
    print(f"{'path':<12} {'MB sent':>9} {'buckets':>8} {'seconds':>8} {'GB/s':>7} {'x memcpy':>9}")
    for name, (sec, nbytes, buckets) in res["rows"].items():
        gbps = nbytes / 1e9 / sec
        print(
            f"{name:<12} {nbytes / 1e6:9.1f} {buckets:8d} {sec:8.3f} {gbps:7.3f} "
            f"{gbps / memcpy:9.3f}"
        )
    print(
        f"{'memcpy':<12} {res['rows']['tensor'][1] / 1e6:9.1f} {'':>8} {'':>8} {memcpy:7.3f} "
        f"{1.0:9.3f}"
    )
    print("\nQwen3-30B-A3B estimate (transport time only = bytes / link; gathers not included):")
    head = " ".join(f"{f'@{b:g} GB/s':>11}" for b in args.link_gbps)
    print(f"{'format':<6} {'tensors':>8} {'GB':>7} {'buckets@512MiB':>15} {head}")
    for use_fp8 in (False, True):
        n, nbytes, buckets = estimate(512 * 1024**2, use_fp8)
        secs = " ".join(f"{nbytes / 1e9 / b:10.2f}s" for b in args.link_gbps)
        print(f"{'fp8' if use_fp8 else 'bf16':<6} {n:8d} {nbytes / 1e9:7.2f} {buckets:15d} {secs}")


if __name__ == "__main__":
    main()
