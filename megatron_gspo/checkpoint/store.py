"""Checkpoints: the one module that owns their on-disk layout (save, load, `latest`, `step_*`,
the manifest, verify); the names of the files in a step directory are in `checkpoint/files.py`.

`<checkpoint.dir>/step_NNNNNN/` holds the megatron-core distributed checkpoint of the model and
optimizer, `trainer_rank<r>.pt` (step, RNG, policy state), `rollout.pt` (rank 0's data position)
and `hf_config/`; `<checkpoint.dir>/latest` names the newest complete one.

Every checkpoint directory carries `checksums.json` (sha256 and size of every other file in it,
sub-directories included), written by `write_manifest` while the directory still has its
temporary name: a directory named `step_N` is complete. Complete means every file a checkpoint
must have (`required_files`: each rank's `__<rank>_0.distcp` shard, `trainer_rank<r>.pt` and
`adam_steps_rank<r>.pt`, `.metadata`, ...), not just the files that happen to be there:
`write_manifest` refuses to seal a directory that lacks one and `verify` refuses a manifest
that does not list one (e.g. a step directory two runs wrote into at once).

`--resume` checks the checkpoint that `latest` names before anything is loaded and refuses a
damaged one, naming the first bad file and the earlier checkpoints to fall back to (by hand: a
silent fall-back would replay steps the user believes done). Both are collective: each rank
hashes its share of the files.

`check_resume_layout` (preflight, no megatron-core) refuses a resume at a parallel layout or
world size other than the checkpoint's: the optimizer state (`dp_reshardable`) is only tested
to resume at the layout it was written at.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.checkpoint.files import FRESH_OPTIMIZER, HF_CONFIG_DIR, META_FILE, RUN_CONFIG
from megatron_gspo.config_io import ConfigError, require
from megatron_gspo.dist import rank
from megatron_gspo.layout import Layout
from megatron_gspo.run import faults

if TYPE_CHECKING:
    from megatron_gspo.config import Config
    from megatron_gspo.megatron.policy import Policy
    from megatron_gspo.rollout.experience import Rollout

__all__ = [
    "LATEST",
    "MANIFEST",
    "check_resume_layout",
    "has_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "required_files",
    "save_checkpoint",
    "step_dir_name",
    "verify",
    "write_manifest",
]

MANIFEST = "checksums.json"
LATEST = "latest"
"""The file in `checkpoint.dir` that names the newest complete `step_*` directory."""
_CHUNK = 1 << 22


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint written after `step`."""
    return f"step_{step:06d}"


def step_dirs(root: str | Path) -> list[Path]:
    """The complete `step_*` directories under `root`, oldest first (temporary ones excluded)."""
    return sorted(
        p for p in Path(root).glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
    )


def has_checkpoint(root: str | Path) -> Path | None:
    """`<root>/latest` when a run has checkpointed into `root`, else None."""
    marker = Path(root) / LATEST
    return marker if marker.exists() else None


def remove_checkpoints(root: str | Path) -> None:
    """--overwrite: remove `latest` and our own `step_*` directories (temporary ones too), and
    nothing else: `checkpoint.dir` may hold other files of the user's."""
    root = Path(root)
    (root / LATEST).unlink(missing_ok=True)
    for p in root.glob("step_*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `<root>/latest` names (None when there is no `latest`); a ConfigError
    when it names nothing."""
    latest = Path(root) / LATEST
    if not latest.exists():
        return None
    name = latest.read_text().strip()
    path = latest.parent / name
    require(
        bool(name) and path.is_dir(),
        f"{latest} names {name!r}, which is not a checkpoint directory in {latest.parent}; "
        "write the name of an existing step_* directory into it, or start a new run",
    )
    return path


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def _gather(local: object) -> list[Any]:
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [local]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, local)
    return out


def _share(items: list[str]) -> list[str]:
    import torch

    if not torch.distributed.is_initialized():
        return items
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return items[rank::world]


def required_files(world_size: int, directory: str | Path | None = None) -> list[str]:
    """The files every checkpoint of a `world_size`-rank job has (megatron-core's torch_dist
    writer gives each rank at least the shard file `__<rank>_0.distcp`); the Adam-step side
    files unless `directory` is marked as written before any optimizer step."""
    shared = [".metadata", "metadata.json", META_FILE, f"{HF_CONFIG_DIR}/config.json", "rollout.pt"]
    fresh = directory is not None and (Path(directory) / FRESH_OPTIMIZER).exists()
    names = ("__{r}_0.distcp", "trainer_rank{r}.pt") + (() if fresh else ("adam_steps_rank{r}.pt",))
    per_rank = [name.format(r=r) for r in range(world_size) for name in names]
    return sorted(shared + per_rank)


def _world_size() -> int:
    import torch

    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def write_manifest(directory: str | Path) -> None:
    """Collective, once every rank's files are in `directory`: rank 0 writes `checksums.json`.
    Raises RuntimeError on every rank (and writes nothing) when a required file is missing."""
    directory = Path(directory)
    mine = {
        name: {"sha256": _digest(directory / name), "bytes": (directory / name).stat().st_size}
        for name in _share(_files(directory))
    }
    entries: dict[str, Any] = {}
    for part in _gather(mine):
        entries.update(part)
    world = _world_size()
    missing = [name for name in required_files(world, directory) if name not in entries]
    if missing:  # the same verdict on every rank: each has every rank's entries
        raise RuntimeError(
            f"{directory}: the checkpoint lacks {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} after every rank wrote it (did another run "
            "write into the same checkpoint.dir?); it is not sealed and `latest` is unchanged"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        manifest = {
            "algorithm": "sha256",
            "world_size": world,
            "files": dict(sorted(entries.items())),
        }
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _problem(directory: Path, name: str, want: dict[str, Any]) -> str | None:
    path = directory / name
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"{size} bytes, the checkpoint wrote {want['bytes']} (truncated or replaced)"
    if _digest(path) != want["sha256"]:
        return "its sha256 differs from the one written with the checkpoint (corrupted)"
    return None


def verify(directory: str | Path) -> None:
    """Collective: a ConfigError naming the first damaged or missing file of the checkpoint in
    `directory` (the same verdict on every rank)."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        files, local = None, [(MANIFEST, "missing")]
    except (ValueError, KeyError, TypeError) as e:
        files, local = None, [(MANIFEST, f"unreadable ({e})")]
    if files is not None:
        local = [
            (name, why)
            for name in _share(sorted(files))
            if (why := _problem(directory, name, files[name])) is not None
        ]
        local += [(name, why) for name, why in _unlisted(directory, files)]
    found = sorted(p for part in _gather(local) for p in part)
    if found:
        name, why = found[0]
        more = f" (and {len(found) - 1} more files)" if len(found) > 1 else ""
        raise ConfigError(
            f"{directory / name}: {why}{more}; the checkpoint cannot be resumed. "
            f"{_fallback_hint(directory)}"
        )


def _unlisted(directory: Path, files: dict[str, Any]) -> list[tuple[str, str]]:
    """Required files the manifest does not list (checked on rank 0 only: one report each)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return []
    try:
        world = int(json.loads((directory / META_FILE).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        world = 1  # META_FILE itself is then reported as not listed or damaged
    return [
        (name, "not in the checkpoint's manifest: the checkpoint is incomplete")
        for name in required_files(world, directory)
        if name not in files
    ]


def _fallback_hint(directory: Path) -> str:
    earlier = sorted(
        p.name
        for p in directory.parent.glob("step_*")
        if p.is_dir() and not p.name.endswith(".tmp") and p.name < directory.name
    )
    if not earlier:
        return "There is no earlier checkpoint: start a new run (--overwrite)."
    return (
        f"To resume from the earlier {earlier[-1]} instead, write {earlier[-1]} into "
        f"{directory.parent / 'latest'}."
    )


def _resolved(layout: Layout, world_size: int) -> dict[str, Any]:
    grid = layout.tp * layout.pp * layout.cp
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "cp": layout.cp,
        "ep": layout.ep,
        "etp": layout.expert_tp,
        "sp": layout.sp,
        "dp": world_size // grid if world_size % grid == 0 else None,
        "world": world_size,
    }


def _describe(r: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in r.items() if k != "world"]
    return f"{' '.join(parts)} on {r['world']} ranks"


def check_resume_layout(checkpoint_dir: str | None, layout: Layout, world_size: int) -> None:
    """Preflight of `--resume`: the checkpoint `latest` names was written at `layout` on
    `world_size` ranks, or a one-line ConfigError naming both layouts."""
    if checkpoint_dir is None:
        return
    path = latest_checkpoint(checkpoint_dir)
    if path is None:
        return
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
        saved = _resolved(Layout(**meta["layout"]), int(meta["world_size"]))
    except (OSError, ValueError, KeyError, TypeError, ConfigError) as e:
        raise ConfigError(
            f"{meta_file}: cannot read the checkpoint's layout ({e}); the checkpoint cannot "
            f"be resumed. {_fallback_hint(path)}"
        ) from None
    now = _resolved(layout, world_size)
    require(
        saved == now,
        f"{path}: written at layout {_describe(saved)}, this run has {_describe(now)}; resume "
        "with the checkpoint's layout (parallel.* and the number of ranks): its optimizer "
        "state resumes only at the layout it was written at",
    )


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------
def save_checkpoint(cfg: Config, policy: Policy, rollout: Rollout | None, step: int) -> Path:
    """Model + optimizer (megatron-core dist checkpoint) and trainer state of the run `cfg`,
    written to a temporary directory with a manifest of checksums (`write_manifest`) and
    renamed, so a crash mid-save never leaves a half checkpoint under a final name."""
    root = Path(_checkpoint_dir(cfg))
    final = root / step_dir_name(step)
    tmp = final.with_name(final.name + ".tmp")
    from megatron_gspo.checkpoint.write import WriteState
    from megatron_gspo.megatron.checkpoint import save_model_and_optimizer
    from megatron_gspo.weights.convert import write_source_info

    # Each phase's write error is shared at its end (`agree`, in place of a barrier): a full
    # or read-only disk ends every rank with one CheckpointWriteError (checkpoint/write.py).
    w = WriteState(root, step, tmp)
    with w.phase():
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            # The resolved config: a resume compares it (checkpoint.resume.resume_config_changes)
            (tmp / RUN_CONFIG).write_text(json.dumps(cfg.to_dict(), default=str) + "\n")
    w.agree()
    with w.phase():
        save_model_and_optimizer(policy.model, policy.optimizer, tmp)
        # hf_config/ + metadata: tools/convert_megatron_to_hf.py turns this step into a HF model
        write_source_info(tmp, cfg.model.hf_path, policy.bridge, policy.model, policy.layout)
        from megatron_gspo.megatron.rng import rng_state

        # torch, Python, CUDA and megatron-core's TP tracker generators (megatron/rng.py)
        state = {"step": step, **rng_state(), "policy": policy.state_dict()}
        torch.save(state, tmp / f"trainer_rank{rank()}.pt")
        if rollout is not None:
            torch.save(rollout.state_dict(), tmp / "rollout.pt")
        faults.point("checkpoint", step)
    w.agree()
    with w.phase():
        write_manifest(tmp)  # collective; only a complete directory gets its final name
    w.agree()
    with w.phase():
        if rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            (root / LATEST).write_text(final.name)
            keep = cfg.checkpoint.keep_last
            for p in step_dirs(root)[:-keep] if keep else []:
                shutil.rmtree(p, ignore_errors=True)
    w.agree()
    return final


def load_checkpoint(cfg: Config, policy: Policy, rollout: Rollout | None) -> int:
    """Restore the latest checkpoint of the run `cfg`; returns the step to continue from (0 if
    none). Its integrity is checked before (`verify`, in `train.main`)."""
    path = latest_checkpoint(_checkpoint_dir(cfg))
    if path is None:
        return 0
    from megatron_gspo.megatron.checkpoint import load_model_and_optimizer

    load_model_and_optimizer(policy.model, policy.optimizer, path)
    state = torch.load(path / f"trainer_rank{rank()}.pt", weights_only=True)
    from megatron_gspo.megatron.rng import set_rng_state

    set_rng_state(state)
    policy.load_state_dict(state["policy"])
    if rollout is not None:
        rollout.load_state_dict(torch.load(path / "rollout.pt", weights_only=True))
    return int(state["step"])


def _checkpoint_dir(cfg: Config) -> str:
    directory = cfg.checkpoint.dir
    if directory is None:  # the config refuses resume/save_every without it; callers check
        raise ValueError("checkpoint.dir is not set")
    return directory
