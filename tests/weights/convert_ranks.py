"""Rank program of the conversion tests (spawned by tests/weights/test_convert.py).

HF -> torch_dist at TP2, EP2, PP2 and CP2; each checkpoint back to HF at its own layout (round
trip) and at another one (resharding); logits of a model loaded from a checkpoint written at
another layout vs the same layout built straight from HF; the layout recorded in each
checkpoint; `export_hf` into an existing export (no stale shards) vs the in-memory `hf_state`;
and the error paths (existing output, a layout that does not fit, a checkpoint missing a
tensor).
"""

from __future__ import annotations

import shutil
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
from megatron_gspo.testing.weights import hf_state, load_hf_state
from megatron_gspo.weights import convert, hf_io

LAYOUTS = {"tp2": Layout(tp=2), "ep2": Layout(ep=2), "pp2": Layout(pp=2), "cp2": Layout(cp=2)}
# (checkpoint layout, load layout): the diagonal is a round trip, the rest reshard.
EXPORTS = [
    ("tp2", "tp2"),
    ("ep2", "ep2"),
    ("pp2", "pp2"),
    ("tp2", "ep2"),
    ("ep2", "pp2"),
    ("pp2", "tp2"),
    ("cp2", "ep2"),
    ("tp2", "cp2"),
]
# Logits need a non-pipelined model here (one forward call).
LOGITS = [("pp2", "tp2"), ("tp2", "ep2"), ("ep2", "tp2")]
DROPPED = "model.layers.1.mlp.experts.2.up_proj.weight"


def _logits(model: list[torch.nn.Module], vocab: int) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, vocab, (2, 16), generator=g)
    positions = torch.arange(16).expand_as(tokens)
    m = model[0].eval()
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(m(tokens, positions, None))


def _error(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test asserts on type and text
        return f"{type(e).__name__}: {e}"
    return "no error"


def main(rank: int, world: int, root: str) -> dict[str, Any]:
    quiet_megatron()
    root_p = Path(root)
    hf = root_p / "hf"
    out: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        convert.hf_to_megatron(hf, root_p / f"mc_{name}", layout)
        out[f"meta_{name}"] = convert.read_source_info(root_p / f"mc_{name}")["layout"]
    for src, dst in EXPORTS:
        convert.megatron_to_hf(root_p / f"mc_{src}", root_p / f"hf_{src}_{dst}", LAYOUTS[dst])
    torch.distributed.barrier()
    if rank == 0:
        original = load_hf_state(hf)
        for src, dst in EXPORTS:
            back = load_hf_state(root_p / f"hf_{src}_{dst}")
            out[f"export_{src}_{dst}"] = {
                "missing": sorted(set(original) - set(back)),
                "extra": sorted(set(back) - set(original)),
                "unequal": sorted(
                    n
                    for n in set(original) & set(back)
                    if original[n].dtype != back[n].dtype or not torch.equal(original[n], back[n])
                ),
                "files": sorted(p.name for p in (root_p / f"hf_{src}_{dst}").iterdir()),
            }
    bridge = load_bridge(hf)
    vocab = hf_io.hf_config_of(bridge).vocab_size
    for src, dst in LOGITS:
        _, model = convert.load_megatron(root_p / f"mc_{src}", LAYOUTS[dst])
        resharded = _logits(model, vocab)
        init_megatron(LAYOUTS[dst])
        direct = _logits(build_model(make_provider(bridge, LAYOUTS[dst]), load_from=bridge), vocab)
        out[f"logits_{src}_{dst}"] = {
            "equal": torch.equal(resharded, direct),
            "max_diff": float((resharded - direct).abs().max()),
            "shape": tuple(resharded.shape),
        }
    # export_hf as the trainer calls it (hf_dir: the source model), twice into the same
    # directory: first in many small shards, then in one; the second replaces the first.
    bridge, model = convert.load_megatron(root_p / "mc_ep2", LAYOUTS["ep2"])
    exported = root_p / "exported"
    out["export_hf_small"] = convert.export_hf(bridge, model, exported, hf_dir=hf, shard_bytes=1)
    out["export_hf"] = convert.export_hf(bridge, model, exported, hf_dir=hf)
    in_memory = hf_state(bridge, model)  # on every rank
    if rank == 0:
        written = load_hf_state(exported)
        out["export_hf_files"] = sorted(p.name for p in exported.iterdir())
        out["export_hf_equal"] = written.keys() == in_memory.keys() and all(
            torch.equal(written[k], in_memory[k]) for k in written
        )
    out["hf_state_keys"] = len(in_memory)
    # Error paths (each raises on every rank before any collective could hang).
    out["overwrite"] = _error(convert.hf_to_megatron, hf, root_p / "mc_tp2", LAYOUTS["tp2"])
    out["bad_layout"] = _error(
        convert.hf_to_megatron, hf, root_p / "mc_bad", Layout(ep=3), force=True
    )
    if rank == 0:
        from safetensors.torch import save_file

        broken = root_p / "hf_broken"
        shutil.copytree(hf, broken)
        state = load_hf_state(broken)
        state.pop(DROPPED)
        for f in broken.glob("*.safetensors"):
            f.unlink()
        save_file(state, str(broken / "model.safetensors"), metadata={"format": "pt"})
    torch.distributed.barrier()
    out["missing_tensor"] = _error(
        convert.hf_to_megatron, root_p / "hf_broken", root_p / "mc_broken", LAYOUTS["ep2"]
    )
    # --force replaces an existing output.
    convert.megatron_to_hf(root_p / "mc_tp2", root_p / "hf_tp2_tp2", LAYOUTS["tp2"], force=True)
    out["forced"] = sorted(p.name for p in (root_p / "hf_tp2_tp2").iterdir())
    return out
