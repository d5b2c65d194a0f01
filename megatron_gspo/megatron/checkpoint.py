"""Model + optimizer checkpoints through megatron-core's distributed checkpointing.

Every rank calls `save_model_and_optimizer` / `load_model_and_optimizer` (training) or
`save_model` / `load_model_states` (conversion tools) with its own model chunks and, for
training, the (possibly chained, possibly distributed) megatron-core optimizer. The directory
must exist (the caller owns naming, atomic renames and retention). Model tensors are keyed
globally, so the model part loads at any layout; optimizer state resumes at the same TP/PP/EP.

Format: megatron-core `torch_dist` with `distrib_optim_sharding_type="dp_reshardable"`. With
megatron-core 0.19 and no Apex/TE, the default "fully_sharded_model_space" is refused by the
torch_dist writer (flattened ranges) and "fully_reshardable" fails to load torch Adam's `step`;
"dp_reshardable" resumes at the same TP/PP/EP layout with any DP size. torch Adam's per-parameter
`step` is not part of that format, so it is saved next to it (`adam_steps_rank{r}.pt`) by the
registered patch `mcore-adam-step-resume` (megatron_gspo/patches/optimizer.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.checkpoint.files import FRESH_OPTIMIZER, OPTIMIZER_FILE
from megatron_gspo.patches.optimizer import chained, optimizer_classes, resume_hooks

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The chunk inside megatron-core's DDP wrapper (checkpoint keys without `module.`)."""
    return getattr(chunk, "module", chunk)


def model_sharded_state(
    model: list[torch.nn.Module], metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The model part of a checkpoint: `model` for one chunk, `model0..` for virtual pipeline
    chunks, as Megatron-LM nests them. The ShardedTensor keys inside are global (layer offsets,
    expert ids, TP slices), so the nesting does not constrain resharding. Shared with the
    conversion tools, so that a training checkpoint converts to HF at any layout."""
    sds = [_unwrap(m).sharded_state_dict(metadata=metadata) for m in model]  # type: ignore[operator]
    return {"model": sds[0]} if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}


def _chunk_states(loaded: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    return (
        [loaded["model"]] if num_chunks == 1 else [loaded[f"model{i}"] for i in range(num_chunks)]
    )


def save_model(model: list[torch.nn.Module], directory: str | Path) -> None:
    """Collective: the model alone (the conversion tools' checkpoints)."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()
    dist_checkpointing.save(model_sharded_state(model), str(directory))


def load_model_states(model: list[torch.nn.Module], directory: str | Path) -> list[dict]:
    """Collective: each chunk's state dict for `model`'s layout, read from a checkpoint written
    by `save_model` or `save_model_and_optimizer` at any layout (optimizer state is not read)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model_sharded_state(model), str(directory))
    return _chunk_states(loaded, len(model))


def _sharded_state(
    model: list[torch.nn.Module], optimizer: MegatronOptimizer, is_loading: bool
) -> dict:
    model_sd = model_sharded_state(model, _METADATA)
    # Nested, not flattened: virtual pipeline chunks share local keys (each has its own
    # "decoder.layers.0..."), and the optimizer matches its params to sharded tensors by identity.
    optim = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_METADATA)
    return {**model_sd, "optimizer": optim}


def _has_stepped(optimizer: MegatronOptimizer) -> bool:
    """Whether any rank's optimizer holds state (a step was taken); identical on every rank."""
    from megatron_gspo import dist

    local = any(len(opt.optimizer.state) > 0 for opt in chained(optimizer))
    flag = torch.tensor([float(local)], device=dist.device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def _in_process_results_queue() -> None:
    """megatron-core's torch_dist writer hands its write results to the saving rank through a
    queue that it creates on the first save (`filesystem_async.get_write_results_queue`, cached
    in the module global `_results_queue`): a `multiprocessing` Manager's queue, i.e. a spawned
    server process. Every save here is synchronous (`AsyncRequest.execute_sync`: the writer's
    threads run in this process and put into the queue, the finalize step reads it in this
    process), so a thread-safe in-process queue does the same job without the process: it
    cannot outlive a SIGKILLed rank (the Manager did, holding the job's stdout open), and the
    first save no longer waits for it to start and to import torch (~4 CPU-s per rank: a
    spawned child re-imports the trainer's main module, then torch to unpickle the results).
    """
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", True) is not None:
        return  # ours already, or megatron-core no longer caches one there
    filesystem_async._results_queue = queue.Queue()


def save_model_and_optimizer(
    model: list[torch.nn.Module], optimizer: MegatronOptimizer, directory: Path
) -> None:
    """Collective: every rank writes its shards of the model and optimizer into `directory`."""
    from megatron.core import dist_checkpointing

    _in_process_results_queue()

    hooks = resume_hooks()
    rank = torch.distributed.get_rank()
    if not _has_stepped(optimizer):
        # megatron-core's distributed optimizer cannot save a state no step has created (its
        # state_dict asserts on the missing `step`): the model alone is the whole state here.
        dist_checkpointing.save(model_sharded_state(model, _METADATA), str(directory))
        if rank == 0:
            (Path(directory) / FRESH_OPTIMIZER).write_text("no optimizer step taken yet\n")
        return
    dist_checkpointing.save(_sharded_state(model, optimizer, False), str(directory))
    torch.save(hooks.adam_steps(optimizer), Path(directory) / f"adam_steps_rank{rank}.pt")
    if rank == 0:  # which optimizer's state this is: a resume checks it before building one
        classes = {"classes": optimizer_classes(optimizer)}
        (Path(directory) / OPTIMIZER_FILE).write_text(json.dumps(classes) + "\n")


def _saved_param_groups(state: object) -> list[dict[str, Any]]:
    """Every param-group dict of a loaded optimizer state, in the order of `chained`."""
    found: list[dict[str, Any]] = []
    if isinstance(state, dict):
        groups = state.get("param_groups")
        if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
            return list(groups)
        for value in state.values():
            found += _saved_param_groups(value)
    elif isinstance(state, list | tuple):
        for value in state:
            found += _saved_param_groups(value)
    return found


# Set per group by megatron-core from the parameter's kind (expert, bias/norm), not from the
# config: they must agree for two groups to be the same group.
_STRUCTURAL = ("is_expert_parallel", "is_decoupled_lr", "lr_mult", "wd_mult")


def adopt_current_param_groups(optimizer: MegatronOptimizer, saved_state: object) -> None:
    """Resume with changed optimizer settings (optim.lr, min_lr, weight_decay...): the saved
    param groups take this run's values of the keys megatron-core identifies groups by
    (`param_group_identifier_keys`: max_lr, min_lr, start_wd, end_wd...), in place.

    Without this, the distributed optimizer's `load_state_dict` pairs current and saved groups
    by those values and fails with a `KeyError` of the tuple when any differs, and the plain
    optimizer takes the saved groups whole, so the scheduler would keep the old `max_lr`. The
    groups pair by position (same model, same layout: preflight checks both), checked by their
    structural flags; the new values apply from the resumed step on (the scheduler sets each
    group's lr from them when its state is loaded)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    current = [g for opt in chained(optimizer) for g in opt.optimizer.param_groups]
    saved = _saved_param_groups(saved_state)
    if len(saved) != len(current):
        return  # another structure: leave megatron-core's own matching (and error) to it
    for old, new in zip(saved, current, strict=True):
        if any(old.get(k) != new.get(k) for k in _STRUCTURAL if k in old and k in new):
            return
    for old, new in zip(saved, current, strict=True):
        for key in param_group_identifier_keys:
            if key in new and key not in _STRUCTURAL:
                old[key] = new[key]


def load_model_and_optimizer(
    model: list[torch.nn.Module], optimizer: MegatronOptimizer, directory: Path
) -> None:
    """Collective: restore what `save_model_and_optimizer` wrote, in place."""
    from megatron.core import dist_checkpointing

    if (Path(directory) / FRESH_OPTIMIZER).exists():
        for m, sd in zip(model, load_model_states(model, directory), strict=True):
            _unwrap(m).load_state_dict(sd)
        optimizer.reload_model_params()  # fresh optimizer: its main params follow the model
        return
    hooks = resume_hooks()  # upstream workaround: see megatron_gspo.patches.optimizer
    hooks.init_states_for_load(optimizer)  # placeholder state, overwritten by the load
    loaded = dist_checkpointing.load(_sharded_state(model, optimizer, True), str(directory))
    for m, sd in zip(model, _chunk_states(loaded, len(model)), strict=True):
        _unwrap(m).load_state_dict(sd)
    adopt_current_param_groups(optimizer, loaded["optimizer"])
    with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
        optimizer.load_state_dict(loaded["optimizer"])
    # No `reload_model_params()` here: the optimizer state just restored the fp32 main params,
    # and reloading would overwrite them with the bf16 model params (rounding away every update
    # smaller than a bf16 ulp). megatron-core's own `load_checkpoint` reloads only when it did
    # not load the optimizer state (the fresh-optimizer branch above). In fp32 the main params
    # alias the model params, so the call was a no-op there and only bf16 showed it.
    rank = torch.distributed.get_rank()
    steps = torch.load(Path(directory) / f"adam_steps_rank{rank}.pt", weights_only=True)
    hooks.restore_adam_steps(optimizer, steps)
