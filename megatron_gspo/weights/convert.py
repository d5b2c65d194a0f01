"""HF checkpoint <-> megatron-core distributed checkpoint (`torch_dist`), at any parallel layout.

Both directions run on every rank of a `torchrun` job (gloo on CPU, nccl on GPU) and use
megatron-bridge's model mappings (Qwen3-MoE, Qwen3, Llama-style, ...):

* `hf_to_megatron`: build the model for the layout, load the HF safetensors through the bridge,
  and save `sharded_state_dict()` with `megatron.core.dist_checkpointing.save`. Sharded keys
  are global (layer offsets, expert ids, TP slices), so the checkpoint can be loaded at any
  other layout (resharding is dist_checkpointing's job).
* `megatron_to_hf`: build the model for the (possibly different) layout, load the checkpoint,
  and write it with `export_hf`.
* `export_hf`: the one writer of HF checkpoints from a live model (the converter and the
  trainer's final export): safetensors shards from the bridge's export on rank 0, in the
  original HF dtype, next to the source's config, tokenizer and generation files.

The Megatron checkpoint directory also holds `hf_config/` (config.json, tokenizer and
generation files of the source) and `mgspo_conversion.json` (with the layout it was written
at), so the reverse conversion needs nothing but the directory. Layouts are
`megatron_gspo.layout.Layout`, checked by `Layout.validate` with the flags' names.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo import dist
from megatron_gspo.checkpoint.files import HF_CONFIG_DIR, META_FILE
from megatron_gspo.config_io import ConfigError
from megatron_gspo.layout import HFConfig, HFConfigLike, Layout, hf_value
from megatron_gspo.megatron.checkpoint import load_model_states, save_model
from megatron_gspo.megatron.model import (
    build_model,
    init_megatron,
    load_bridge,
    make_provider,
    quiet_megatron,
)
from megatron_gspo.run.console import (
    THIRD_PARTY_LOG,
    hold_third_party_output,
    release_held_output,
    route_third_party_output,
    routed_stdio,
)
from megatron_gspo.weights import hf_io
from megatron_gspo.weights.stream import hf_tensors

if TYPE_CHECKING:
    from megatron.bridge import AutoBridge

DEFAULT_SHARD_BYTES = 4 * 1024**3


class ConversionError(RuntimeError):
    """A conversion cannot proceed (bad layout, missing tensor, existing output, ...)."""


def _say(msg: str) -> None:
    if dist.rank() == 0:
        print(f"[convert] {msg}", flush=True)


def check_layout(layout: Layout, hf_config: HFConfig) -> int:
    """`Layout.validate` for this job's world size, with the command-line flags' names in the
    message; raises `ConversionError`. Returns the data-parallel size."""
    try:
        return layout.validate(dist.world_size(), hf_config, key="--")
    except ConfigError as e:
        raise ConversionError(f"layout {layout.name()} does not fit: {e}") from e


# What each direction writes into its output directory; anything else there is the user's.
# THIRD_PARTY_LOG: the libraries' output during the conversion (`cli`).
MEGATRON_OUTPUT = (
    *("*.distcp", ".metadata", "common.pt", "metadata.json", META_FILE, HF_CONFIG_DIR),
    THIRD_PARTY_LOG,
)
HF_OUTPUT = ("*.safetensors", hf_io.INDEX_NAME, "config.json", *hf_io.SIDE_FILES, THIRD_PARTY_LOG)


def _check_output(out_dir: Path, force: bool, writes: tuple[str, ...], src: Path) -> None:
    """Before any work, nothing deleted: the output is not the input (or inside / around it),
    holds nothing this tool does not write, and a previous output is replaced only with
    `force` (was: `--force` removed the whole directory, unrelated files included)."""
    out_r, src_r = out_dir.resolve(), src.resolve()
    if out_r == src_r or src_r in out_r.parents or out_r in src_r.parents:
        raise ConversionError(
            f"-o {out_dir} overlaps -i {src}: the conversion would overwrite its own input; "
            "choose an output directory outside it"
        )
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ConversionError(f"-o {out_dir} is a file, not a directory; choose another -o")
    entries = sorted(out_dir.iterdir())
    foreign = [p.name for p in entries if not _written_by(p.name, writes)]
    if foreign:
        raise ConversionError(
            f"-o {out_dir} holds {foreign[0]!r}"
            f"{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}, which this tool "
            "does not write; it replaces only its own previous output (even with --force): "
            "choose an empty or new directory, or move those files out"
        )
    if entries and not force:
        raise ConversionError(
            f"-o {out_dir} holds a previous output of this tool; pass --force to replace it"
        )


def _written_by(name: str, writes: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in writes)


def _prepare_output(out_dir: Path, force: bool, writes: tuple[str, ...], src: Path) -> None:
    """`_check_output`; rank 0 then removes what a previous run of this tool wrote there (only
    that), everyone waits."""
    _check_output(out_dir, force, writes, src)
    dist.barrier()  # nobody may still be reading it
    if dist.rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        for p in out_dir.iterdir():
            if _written_by(p.name, writes):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    dist.barrier()


def write_source_info(
    out_dir: Path,
    hf_dir: str | Path,
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    layout: Layout,
) -> dict[str, Any]:
    """Rank 0 writes `hf_config/` (config, tokenizer and generation files of `hf_dir`) and
    `mgspo_conversion.json` into a Megatron checkpoint directory, which is all
    `megatron_to_hf` needs besides the weights. Returns the metadata (on every rank)."""
    hf_dir = Path(hf_dir)
    meta = {
        "format": "torch_dist",
        "source": str(hf_dir.resolve()),
        "layout": layout.to_dict(),
        "world_size": dist.world_size(),
        "param_dtype": str(next(model[0].parameters()).dtype).removeprefix("torch."),
        "hf_dtype": str(_hf_dtype(hf_io.hf_config_of(bridge))).removeprefix("torch."),
    }
    if dist.rank() == 0:
        cfg_dir = Path(out_dir) / HF_CONFIG_DIR
        cfg_dir.mkdir(exist_ok=True)
        shutil.copy2(hf_dir / "config.json", cfg_dir / "config.json")
        hf_io.copy_side_files(hf_dir, cfg_dir)
        (Path(out_dir) / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def read_source_info(ckpt_dir: str | Path) -> dict[str, Any]:
    """The metadata `write_source_info` wrote, with `layout` as a `Layout` (the one the
    checkpoint was written at; it loads at any other)."""
    path = Path(ckpt_dir) / META_FILE
    if not path.is_file() or not (Path(ckpt_dir) / HF_CONFIG_DIR).is_dir():
        raise ConversionError(
            f"{ckpt_dir} is not a checkpoint written by convert_hf_to_megatron or the trainer "
            f"(no {META_FILE} and {HF_CONFIG_DIR}/)"
        )
    meta = json.loads(path.read_text())
    meta["layout"] = Layout(**meta["layout"])
    return meta


def _hf_dtype(hf_config: HFConfigLike) -> torch.dtype:
    """The weights' dtype a HF config declares (a `PretrainedConfig` or config.json's dict)."""
    name = hf_value(hf_config, "torch_dtype") or hf_value(hf_config, "dtype")
    if isinstance(name, torch.dtype):
        return name
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    return torch.float32


def config_bridge(config_dir: str | Path) -> AutoBridge:
    """An `AutoBridge` from a config directory alone (no weights: they come from Megatron)."""
    from transformers import AutoConfig

    from megatron_gspo.patches import apply_bridge_imports

    apply_bridge_imports()
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_config(AutoConfig.from_pretrained(str(config_dir)))


def build_for_layout(
    bridge: AutoBridge, layout: Layout, dtype: torch.dtype | None
) -> list[torch.nn.Module]:
    """Parallel state + model chunks (no weights loaded) for `layout`."""
    check_layout(layout, hf_io.hf_config_of(bridge))
    init_megatron(layout)
    with routed_stdio():  # megatron prints its parameter counts: to the tool's library log
        return build_model(make_provider(bridge, layout, dtype=dtype))


def check_hf_tensors(bridge: AutoBridge, model: list[torch.nn.Module], hf_dir: Path) -> None:
    """Raise `ConversionError` naming the HF tensors this layout needs but `hf_dir` lacks.

    The bridge itself skips a mapping whose HF tensor is absent and leaves that parameter at
    its random initialisation, so the check is done here (collective: ranks own different
    layers and experts).
    """
    tasks = bridge._model_bridge.build_conversion_tasks(hf_io.hf_config_of(bridge), model)
    needed: set[str] = set()
    for task in tasks:
        if task is None:
            continue
        hf_param = task.mapping.hf_param
        needed.update([hf_param] if isinstance(hf_param, str) else hf_param.values())
    available = set(bridge.hf_pretrained.state.source.get_all_keys())
    missing = sorted(needed - available)
    if torch.distributed.is_initialized():
        gathered: list[list[str]] = [[] for _ in range(dist.world_size())]
        torch.distributed.all_gather_object(gathered, missing)
        missing = sorted({n for part in gathered for n in part})
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConversionError(f"{hf_dir} lacks tensors {missing[:5]}{more}")


def hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    layout: Layout,
    *,
    dtype: torch.dtype | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Convert a HF checkpoint into a `torch_dist` Megatron checkpoint (collective).

    dtype: parameter dtype of the Megatron model (default: fp32 on CPU, bf16 on GPU).
    Returns the metadata written to `mgspo_conversion.json`.
    """
    quiet_megatron()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir} is not a HF checkpoint (no config.json)")
    if not list(hf_dir.glob("*.safetensors")):
        raise ConversionError(f"{hf_dir} has no *.safetensors weights")
    _check_output(out_dir, force, MEGATRON_OUTPUT, hf_dir)
    bridge = load_bridge(hf_dir)
    # a layout that does not fit fails here, before --force deletes anything
    check_layout(layout, hf_io.hf_config_of(bridge))
    _prepare_output(out_dir, force, MEGATRON_OUTPUT, hf_dir)
    model = build_for_layout(bridge, layout, dtype)
    check_hf_tensors(bridge, model, hf_dir)
    _say(f"loading {hf_dir} into a {layout.name()} model on {dist.world_size()} ranks")
    bridge.load_hf_weights(model)
    _say(f"saving torch_dist checkpoint to {out_dir}")
    save_model(model, out_dir)
    meta = write_source_info(out_dir, hf_dir, bridge, model, layout)
    dist.barrier()
    _say("done")
    return meta


def load_megatron(
    ckpt_dir: str | Path, layout: Layout, *, dtype: torch.dtype | None = None
) -> tuple[Any, list[torch.nn.Module]]:
    """(bridge, model chunks for `layout`) with weights from a `hf_to_megatron` checkpoint."""
    quiet_megatron()
    ckpt_dir = Path(ckpt_dir)
    meta = read_source_info(ckpt_dir)
    bridge = config_bridge(ckpt_dir / HF_CONFIG_DIR)
    if dtype is None and meta.get("param_dtype"):
        dtype = getattr(torch, meta["param_dtype"])
    model = build_for_layout(bridge, layout, dtype)
    try:
        states = load_model_states(model, ckpt_dir)
    except Exception as e:  # megatron raises CheckpointingException / KeyError with key lists
        raise ConversionError(
            f"cannot load {ckpt_dir} (written at {meta['layout'].name()}) at layout "
            f"{layout.name()}: {type(e).__name__}: {e}"
        ) from e
    for m, sd in zip(model, states, strict=True):
        missing, unexpected = m.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ConversionError(
                f"{ckpt_dir}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}"
            )
    return bridge, model


def megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    layout: Layout,
    *,
    force: bool = False,
    hf_dtype: torch.dtype | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, Any]:
    """Convert a `torch_dist` checkpoint (written at any layout) to a HF directory (collective).

    hf_dtype: dtype of the written weights (default: the source HF checkpoint's dtype).
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    _check_output(out_dir, force, HF_OUTPUT, ckpt_dir)
    bridge, model = load_megatron(ckpt_dir, layout)
    n = export_hf(
        bridge,
        model,
        out_dir,
        hf_dir=ckpt_dir / HF_CONFIG_DIR,
        hf_dtype=hf_dtype,
        shard_bytes=shard_bytes,
    )
    _say("done")
    return {"tensors": n}


def export_hf(
    bridge: AutoBridge,
    model: list[torch.nn.Module],
    out_dir: str | Path,
    *,
    hf_dir: str | Path,
    hf_dtype: torch.dtype | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> int:
    """Write `model` as a HF checkpoint directory `out_dir` (collective: call on every rank).

    The one HF writer: the converter and the trainer's final export (`checkpoint.
    export_hf_at_end`) both call it, so the two agree bitwise on the same weights.
    hf_dir: HF directory whose config.json, tokenizer and generation files are copied (the
        source model, or a converted checkpoint's `hf_config/`).
    hf_dtype: dtype of the written weights (default: the one hf_dir's config.json declares).
    Rank 0 writes a sibling `<out_dir>.tmp` and then replaces `out_dir` with it, so an
    interrupted export never leaves a partial checkpoint and a repeated one no stale shards.
    Returns the number of tensors written (on rank 0; 0 on the others).
    """
    out_dir, hf_dir = Path(out_dir), Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConversionError(f"{hf_dir} has no config.json to write next to the weights")
    config = json.loads((hf_dir / "config.json").read_text())
    hf_dtype = hf_dtype or _hf_dtype(config)
    _say(f"exporting to {out_dir} as {str(hf_dtype).removeprefix('torch.')}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    writer = None
    if dist.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        writer = hf_io.ShardWriter(tmp)
    shard: list[tuple[str, torch.Tensor]] = []
    size = 0
    # Experts go to EP rank 0 (the writer) only, not to every EP rank.
    for name, t in hf_tensors(bridge, model, cpu=True, show_progress=writer is not None):
        if writer is None:
            continue  # other ranks only take part in the gathers
        t = t.detach().to(hf_dtype).clone()
        if shard and size + t.numel() * t.element_size() > shard_bytes:
            writer.write(shard)
            shard, size = [], 0
        shard.append((name, t))
        size += t.numel() * t.element_size()
    if writer is not None:
        if shard:
            writer.write(shard)
        writer.close()
        shutil.copy2(hf_dir / "config.json", tmp / "config.json")
        hf_io.copy_side_files(hf_dir, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out_dir)
    dist.barrier()
    return 0 if writer is None else len(writer.weight_map)


# ---- command line (tools/convert_*.py are thin wrappers) ---------------------------------
def _layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallel layout of the Megatron side (megatron_gspo.layout.Layout)")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    g.add_argument("--vpp", type=int, default=None, help="virtual pipeline chunks per stage")
    g.add_argument("--cp", type=int, default=1, help="context parallel size")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size")
    g.add_argument("--etp", type=int, default=None, help="expert tensor parallel size")


def _layout(ns: argparse.Namespace) -> Layout:
    # Sequence parallelism changes no checkpoint tensor, so the layout's default (on when
    # tp > 1, which MoE with tp > 1 requires) is right for conversion and has no flag.
    return Layout(tp=ns.tp, pp=ns.pp, vpp=ns.vpp, cp=ns.cp, ep=ns.ep, etp=ns.etp)


def cli(direction: str, argv: list[str] | None = None) -> int:
    """`hf_to_megatron` / `megatron_to_hf` from the command line; returns the exit code (2: the
    layout, input or output is wrong, with a message saying which flag to change)."""
    import argparse

    to_megatron = direction == "hf_to_megatron"
    p = argparse.ArgumentParser(
        description=(
            "HF checkpoint -> Megatron torch_dist checkpoint"
            if to_megatron
            else "Megatron torch_dist checkpoint (from convert_hf_to_megatron or the trainer) "
            "-> HF checkpoint"
        ),
        epilog="Run with torchrun --nproc-per-node N; world size must fit the layout.",
    )
    p.add_argument("--input", "-i", required=True, help="source directory")
    p.add_argument("--output", "-o", required=True, help="destination directory")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output")
    _layout_args(p)
    if to_megatron:
        p.add_argument("--dtype", default=None, help="Megatron parameter dtype (float32, ...)")
    else:
        p.add_argument("--hf-dtype", default=None, help="dtype of the written HF weights")
    ns = p.parse_args(argv)
    try:
        layout = _layout(ns)
    except ConfigError as e:  # e.g. --vpp without --pp: argparse's usage error, exit code 2
        p.error(str(e))
    # Library chatter (megatron-bridge's traceback for each optional import it misses, build
    # warnings, deprecations) is held in memory and written to <output>/third_party.log once
    # the conversion succeeded: the output directory is created only after the checks, and a
    # refusal writes nothing. The console keeps our [convert] lines and the progress bars.
    hold_third_party_output()
    dist.init_distributed()
    try:
        if to_megatron:
            dtype = getattr(torch, ns.dtype) if ns.dtype else None
            hf_to_megatron(ns.input, ns.output, layout, dtype=dtype, force=ns.force)
        else:
            hf_dtype = getattr(torch, ns.hf_dtype) if ns.hf_dtype else None
            megatron_to_hf(ns.input, ns.output, layout, force=ns.force, hf_dtype=hf_dtype)
        if Path(ns.output).is_dir():  # another node's rank may not see it: its chatter dropped
            log = route_third_party_output(ns.output)
            _say(f"library output (warnings, notices) in {log}")
    except ConversionError as e:
        release_held_output()  # a refusal: one line; the libraries' chatter is not the cause
        if dist.rank() == 0:
            print(f"error: {e}", flush=True)
        return 2
    except Exception:  # a bug: its traceback follows what the libraries said before it
        sys.stderr.write(release_held_output())
        raise
    finally:
        torch.distributed.destroy_process_group()
    return 0
