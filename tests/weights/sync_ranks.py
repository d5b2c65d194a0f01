"""Rank program of the weight-sync tests (spawned by tests/weights/test_sync.py).

For each layout: build the tiny MoE from the HF checkpoint, take the bridge's HF export as the
reference, then push the weights with each transport to fake engines on rank 0 and compare
what they hold. Rank 0 returns small summaries (names of tensors that differ, errors), never
the tensors themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_gspo.layout import Layout
from megatron_gspo.megatron.model import (
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.testing.weights import block_relative_error, hf_state
from megatron_gspo.weights import fp8
from megatron_gspo.weights.checksum import WeightIntegrityError
from megatron_gspo.weights.sync import WeightSync, WeightSyncConfig
from tests.weights.fake_engine import FakeEngine
from tests.weights.grouped_ranks import grouped_vs_bridge

BUCKET_MB = 64 / 1024  # 64 KiB: the tiny model (~0.36 MB) spans several buckets
CORRUPT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _diff(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Names missing / extra / not bitwise equal (dtype and shape included)."""
    return {
        "missing": sorted(set(expected) - set(got)),
        "extra": sorted(set(got) - set(expected)),
        "unequal": sorted(
            n
            for n in set(expected) & set(got)
            if expected[n].dtype != got[n].dtype or not torch.equal(expected[n], got[n])
        ),
    }


def _fp8_summary(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, Any]:
    quantised = [n for n in ref if fp8.is_quantised_name(n, ref[n])]
    out: dict[str, Any] = {
        "quantised": sorted(quantised),
        "bad": [],
        "worst_ratio": 0.0,
        "worst_rel": 0.0,
    }
    expect_names = set(ref) | {fp8.scale_name(n) for n in quantised}
    out["name_diff"] = sorted(expect_names ^ set(got))
    for n, x in ref.items():
        if n in quantised:
            q, s = got[n], got[fp8.scale_name(n)]
            if q.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
                out["bad"].append(f"{n}: dtypes {q.dtype}/{s.dtype}")
                continue
            if tuple(s.shape) != fp8.scale_shape(x.shape):
                out["bad"].append(f"{n}: scale shape {tuple(s.shape)}")
                continue
            out["worst_ratio"] = max(
                out["worst_ratio"], float(fp8.block_error_ratio(x, q, s).max())
            )
            out["worst_rel"] = max(out["worst_rel"], float(block_relative_error(x, q, s).max()))
        elif not torch.equal(got[n], x.to(torch.bfloat16)):
            out["bad"].append(f"{n}: not the bf16 cast of the export")
    return out


def _push(sync: WeightSync, model: list, engine: FakeEngine | None) -> dict[str, Any]:
    if engine is not None:
        engine.state.clear()
    gather, calls = torch.distributed.gather, []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return gather(*args, **kwargs)

    torch.distributed.gather = counting  # the EP gathers (per tensor or per batch)
    try:
        report = sync.push(model)
    finally:
        torch.distributed.gather = gather
    return {
        "ep_gathers": len(calls),
        "version": report.version,
        "buckets": report.stats.buckets,
        "verified": report.verified,
        "tensors": report.stats.tensors,
        "layout": sync.layout,
        "seen_here": sync.local_stats.tensors_seen,  # this rank's share of the gather traffic
        "direct": sync.local_stats.direct_experts,  # experts not walked by the bridge
    }


def run_layout(
    rank: int, bridge: Any, layout: Layout, syncs: dict[str, tuple[WeightSync, Any]]
) -> dict[str, Any]:
    init_megatron(layout)
    model = build_model(make_provider(bridge, layout), load_from=bridge)
    ref = hf_state(bridge, model)
    out: dict[str, Any] = {"grouped": grouped_vs_bridge(bridge, model, ref)}
    for key, (sync, engine) in syncs.items():
        if key == "corrupt":
            continue
        info = _push(sync, model, engine)
        if rank == 0:
            if key == "fp8":
                info["fp8"] = _fp8_summary(ref, engine.state)
            else:
                dtype = sync.config.torch_dtype
                expected = {n: t.to(dtype) if dtype else t for n, t in ref.items()}
                info["diff"] = _diff(expected, engine.state)
                info["engine_version"] = engine.weight_version()
                info["calls"] = list(engine.calls)
                if engine.disk_config is not None:
                    info["disk_config"] = engine.disk_config
            engine.calls.clear() if engine else None
        out[key] = info
    # A receiver-side bit flip must fail the step on every rank, naming the tensor.
    sync, engine = syncs["corrupt"]
    try:
        _push(sync, model, engine)
        out["corrupt"] = "no error"
    except WeightIntegrityError as e:
        out["corrupt"] = f"WeightIntegrityError: {e}"
    except Exception as e:  # noqa: BLE001 - the test asserts on the type
        out["corrupt"] = f"{type(e).__name__}: {e}"
    return out


def _embedded(rank: int, bridge: Any, hf_dir: str, tmp: str) -> dict[str, Any]:
    """Push a TP2 model to the rollout package's embedded engine (SGLang's HTTP app + an HF
    model) by tensor and disk; the engine's logits must then equal HF's on the same weights.

    The engine starts from another checkpoint, and is reset to it before each transport, so
    each push has to change every weight. (The distributed transport is covered by the fake
    receiver: in one process, the engine and the trainer cannot both join a group of the same
    name.)
    """
    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

    layout = Layout(tp=2)
    init_megatron(layout)
    model = build_model(make_provider(bridge, layout), load_from=bridge)
    out: dict[str, Any] = {}
    server = client = None
    if rank == 0:
        from transformers import AutoModelForCausalLM

        from megatron_gspo.engines.client import ClientConfig, SGLangClient
        from megatron_gspo.engines.embedded.server import EmbeddedServer

        other = str(save_tiny_hf_checkpoint(Path(tmp) / "hf_other", seed=7))
        server = EmbeddedServer(other).start()
        client = SGLangClient(ClientConfig(engine_urls=[server.url]))
        tokens = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits

        def logits() -> torch.Tensor:
            with torch.no_grad():
                return server.policy.model(tokens).logits

    for transport in ("tensor", "disk"):
        if rank == 0:
            client.update_weights_from_disk(other, weight_version="reset")
            before = logits()
        engines = [client] if client is not None else []
        sync = WeightSync(
            bridge,
            engines,
            WeightSyncConfig(
                transport=transport,
                bucket_mb=BUCKET_MB,
                verify_names="common",
                disk_dir=str(Path(tmp) / "embedded_disk"),
            ),
        )
        report = sync.push(model)
        sync.close()
        if rank == 0:
            after = logits()
            out[transport] = {
                "equal_before": torch.equal(before, expected),
                "equal_after": torch.equal(after, expected),
                "max_diff": float((after - expected).abs().max()),
                "version": client.weight_version(),
                "verified": report.verified,
            }
    if server is not None:
        client.close()
        server.stop()
    return out


def _vpp_distopt(rank: int, tmp: str) -> dict[str, Any]:
    """PP2 x VPP2 (4 layers, two model chunks per rank) wrapped in megatron-core DDP with the
    distributed optimizer's buffers: the engine must still receive the export bitwise."""
    from megatron.core.distributed import DistributedDataParallelConfig

    hf4 = Path(tmp) / "hf4"
    if rank == 0:
        from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint

        save_tiny_hf_checkpoint(hf4, seed=5, num_hidden_layers=4)
    torch.distributed.barrier()
    bridge = load_bridge(hf4)
    layout = Layout(pp=2, vpp=2)
    init_megatron(layout)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    model = build_model(make_provider(bridge, layout), ddp_config=ddp, load_from=bridge)
    ref = hf_state(bridge, model)
    engine = FakeEngine("vpp") if rank == 0 else None
    sync_cfg = WeightSyncConfig(bucket_mb=BUCKET_MB, layout="engine")
    sync = WeightSync(bridge, [engine] if engine else [], sync_cfg)
    info = _push(sync, model, engine)
    sync.close()
    info["chunks"] = len(model)
    if rank == 0:
        info["diff"] = _diff(ref, engine.state)
    return info


def main(rank: int, world: int, hf_dir: str, tmp: str, layouts: dict[str, dict]) -> dict:
    quiet_megatron()
    bridge = load_bridge(hf_dir)
    sender = rank == 0

    def engine(name: str, **kw: Any) -> FakeEngine | None:
        return FakeEngine(name, **kw) if sender else None

    def sync(engine_: FakeEngine | None, **cfg: Any) -> tuple[WeightSync, Any]:
        engines = [engine_] if engine_ is not None else []
        # verify_every=1: each layout's push (same WeightSync) is checked, the corruption too
        cfg = {"verify_every": 1, **cfg}
        return WeightSync(bridge, engines, WeightSyncConfig(bucket_mb=BUCKET_MB, **cfg)), engine_

    syncs = {
        "tensor": sync(engine("tensor"), transport="tensor", layout="engine"),  # SGLang's own
        "tensor_hf": sync(engine("tensor_hf"), transport="tensor", layout="hf"),
        "tensor_per_tensor_gathers": sync(
            engine("tensor_ptg"), transport="tensor", batch_expert_gathers=False
        ),
        "tensor_bf16": sync(engine("tensor_bf16"), transport="tensor", dtype="bfloat16"),
        "distributed": sync(engine("distributed"), transport="distributed"),
        "disk_bf16": sync(
            engine("disk"), transport="disk", dtype="bfloat16", disk_dir=str(Path(tmp) / "disk")
        ),
        "fp8": sync(engine("fp8"), transport="tensor", fp8=True),
        "corrupt": sync(engine("corrupt"), transport="tensor"),
    }
    if sender:
        syncs["corrupt"][1].corrupt_name = CORRUPT
    out = {name: run_layout(rank, bridge, Layout(**lay), syncs) for name, lay in layouts.items()}
    for s, _ in syncs.values():
        s.close()
    out["embedded"] = _embedded(rank, bridge, hf_dir, tmp)
    out["vpp_distopt"] = _vpp_distopt(rank, tmp)
    return out
