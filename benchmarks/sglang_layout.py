"""HF-named pushes against SGLang's own layout (`weights.layout=hf|engine`), in one run.

    python benchmarks/sglang_layout.py --count-only            # tensors per push, no server
    python benchmarks/sglang_layout.py --size small --pushes 3  # + the real SGLang CPU server
    python benchmarks/sglang_layout.py --size 2gb --pushes 2

1. Tensors per push for the projection's Qwen3-MoE shapes (`weight_sync.QWEN3`: the HF
   tensors of the checkpoint, no weights; meta tensors through the same `fused_stream` and
   per-rank cut the sender runs), per engine rank, for engine TP 1 and 8 (EP 8).
2. Into the real SGLang 0.5.23 CPU server (bf16, the `weight_sync.SIZES` models): `WeightSync`
   (tensor transport, stand-in bridge yielding the checkpoint's HF tensors, so this measures
   the engine side and the payloads, not Megatron), pushes alternating between the two layouts
   on one server. Per push: wall seconds end to end, and the server's busy time, the CPU
   seconds (user + system, `/proc/<pid>/stat`) of every process of the server over the push.
   The first push of each layout is verified against the server's `/weights_checker` (SGLang's
   own checksums of every parameter) and not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sglang_push_profile import _tree  # noqa: E402
from benchmarks.weight_sync import QWEN3, SIZES, qwen3_moe_hf_shapes, save_bench_model  # noqa: E402


def count_tensors() -> None:
    """Print tensors per push and per engine rank, HF names vs SGLang's own layout."""
    from megatron_gspo.engines.weight_layout import fused_stream, rank_tensors
    from megatron_gspo.engines.weight_shards import EngineLayout

    print("| model | engine TP / EP | HF tensors per push | SGLang layout, per engine rank "
          "| ratio |")
    print("|---|---|---:|---:|---:|")
    for model, cfg in QWEN3.items():
        shapes = qwen3_moe_hf_shapes(cfg)
        named = [(n, torch.empty(s, dtype=torch.bfloat16, device="meta")) for n, s in shapes]
        fused = list(fused_stream(named, num_experts=cfg["num_experts"]))
        hf_cfg = {**cfg, "num_experts": cfg["num_experts"]}
        for tp, ep in ((1, 1), (8, 8)):
            lay = EngineLayout.of(hf_cfg, tp, ep)
            per_rank = len(rank_tensors(fused, 0, lay))
            print(
                f"| {model} | {tp} / {ep} | {len(named):,} | {per_rank:,} | "
                f"1/{len(named) / per_rank:.0f} |"
            )


def _cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total / tick


def push_into_server(size: str, pushes: int, bucket_mb: float) -> None:
    """Time pushes of both layouts into one real SGLang CPU server."""
    from transformers import AutoConfig

    from megatron_gspo.dist import free_port
    from megatron_gspo.engines.client import ClientConfig, SGLangClient
    from megatron_gspo.engines.launch import ServerGroup
    from megatron_gspo.testing import sglang_server
    from megatron_gspo.testing.weights import load_hf_state
    from megatron_gspo.weights.config import WeightSyncConfig
    from megatron_gspo.weights.sync import WeightSync
    from tests.engines.helpers import HFBridge

    python = sglang_server.engine_python()
    if python is None:
        raise SystemExit("no SGLang engine venv: run `bash scripts/engine_env.sh` first")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="mgspo-sglang-layout-") as tmp:
        hf = save_bench_model(Path(tmp) / "hf", size)
        weights = {n: t.to(torch.bfloat16) for n, t in load_hf_state(str(hf)).items()}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        bridge = HFBridge(weights)
        bridge.hf_pretrained = AutoConfig.from_pretrained(str(hf))  # the model's shape
        cfg = sglang_server.cpu_launch_config(  # start-up can take minutes on a loaded host
            str(hf), python=python, log_dir=tmp, base_port=free_port(), startup_timeout_s=1200.0
        )
        group = ServerGroup(cfg)
        group.start()
        client = SGLangClient(ClientConfig(engine_urls=cfg.engine_urls))
        rows: dict[str, list[tuple[float, float, int]]] = {"hf": [], "engine": []}
        phases: dict[str, list[dict[str, float]]] = {"hf": [], "engine": []}
        try:
            syncs = {}
            for layout in rows:
                sync_cfg = WeightSyncConfig(
                    transport="tensor",
                    dtype="bfloat16",
                    experts_to_first=False,
                    verify_every=1_000_000,  # the first push only (checked), then none
                    bucket_mb=bucket_mb,
                    layout=layout,  # type: ignore[arg-type]
                )
                syncs[layout] = WeightSync(bridge, [client], sync_cfg)
                assert syncs[layout].push([]).verified  # every parameter, SGLang's checksums
            pids = _tree(group.engines[0].pid)
            for _ in range(pushes):
                for layout, sync in syncs.items():
                    busy0, t0 = _cpu_seconds(pids), time.perf_counter()
                    report = sync.push([])
                    wall = time.perf_counter() - t0
                    rows[layout].append((wall, _cpu_seconds(pids) - busy0, report.stats.tensors))
                    phases[layout].append(dict(report.stats.seconds))
        finally:
            client.close()
            group.shutdown()
    load1 = os.getloadavg()
    print(
        f"\nreal SGLang CPU server (bf16), size {size}: {nbytes / 1e6:.1f} MB, buckets of "
        f"{bucket_mb:g} MiB, {pushes} timed pushes per layout (alternating); load average "
        f"{load0[0]:.1f} -> {load1[0]:.1f}"
    )
    print("| layout | tensors per push | push wall s (median, each) | server busy CPU s (median) |")
    print("|---|---:|---|---:|")
    med = {}
    for layout, r in rows.items():
        walls, busy = [w for w, _, _ in r], [b for _, b, _ in r]
        med[layout] = (statistics.median(walls), statistics.median(busy))
        each = " ".join(f"{w:.3f}" for w in walls)
        print(f"| {layout} | {r[0][2]} | {med[layout][0]:.3f} ({each}) | {med[layout][1]:.2f} |")
    for layout, ph in phases.items():
        keys = sorted({k for p in ph for k in p})
        meds = ", ".join(f"{k} {statistics.median(p.get(k, 0.0) for p in ph):.3f}" for k in keys)
        print(f"{layout} sender phases (median s): {meds}")
    print(
        f"hf / engine: end to end {med['hf'][0] / med['engine'][0]:.1f}x, server busy "
        f"{med['hf'][1] / max(med['engine'][1], 1e-9):.1f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--count-only", action="store_true")
    args = ap.parse_args()
    count_tensors()
    if not args.count_only:
        push_into_server(args.size, args.pushes, args.bucket_mb)


if __name__ == "__main__":
    main()
