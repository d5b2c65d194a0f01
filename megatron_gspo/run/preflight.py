"""Checks of a run's inputs before anything is started or written.

`train.main` calls `preflight` on every rank before `init_distributed`: each rank reaches the
same verdict from the same files, so a bad input ends every rank with the same one-line
`ConfigError` (exit code 2), instead of rank 0 failing deep inside megatron-core, a tokenizer
or the first rollout while the other ranks wait in a collective. Nothing here imports
megatron-core or executes user code.

    preflight(cfg, resume=args.resume, overwrite=args.overwrite, world_size=4)
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from megatron_gspo.checkpoint.resume import (
    check_checkpoint_dir_writable,
    check_resume_model,
    resume_config_changes,
    saved_optimizer_classes,
)
from megatron_gspo.checkpoint.store import check_resume_layout, latest_checkpoint
from megatron_gspo.config import Config
from megatron_gspo.config_io import ConfigError, require
from megatron_gspo.data.fit import check_prompts_fit
from megatron_gspo.data.formats import load_prompt_records
from megatron_gspo.engines.sglang_rules import check_engine_interpreter
from megatron_gspo.plan.model_files import check_model_files, estimate_checkpoint_bytes
from megatron_gspo.run.run_dir import check_run_paths, previous_run_files

if TYPE_CHECKING:
    from megatron_gspo.data.tokenizer import Tokenizer

__all__ = ["check_optimizer", "check_resume", "check_run_dir", "preflight", "read_hf_config"]


def preflight(cfg: Config, *, resume: bool, overwrite: bool, world_size: int) -> Tokenizer:
    """Every input check that needs no megatron-core: run directory, model directory (its weight
    files as the loaders read them: `model_files`), room for a checkpoint, dtype for
    the device, the layout against `world_size`, the tokenizer, the prompt files and the reward
    module. Raises `ConfigError` (one line naming the file, line or key). Nothing is written or
    deleted here: `--overwrite` clears the previous run only once the new one has started
    (`run_dir.clear_previous_run`, called by `train.main`). Returns the run's tokenizer,
    loaded once here for the prompt checks, for the rollout to take (`make_rollout`)."""
    check_run_paths(cfg)
    check_run_dir(cfg, resume=resume, overwrite=overwrite)
    hf_config = read_hf_config(cfg.model.hf_path, "model.hf_path")
    if cfg.model.tokenizer_path is not None:
        _check_dir(cfg.model.tokenizer_path, "model.tokenizer_path")
    tensors = check_model_files(cfg.model.hf_path) if cfg.model.load_weights else {}
    _check_driver(cfg)
    _check_dtype(cfg)
    cfg.parallel.validate(world_size, hf_config)
    check_checkpoint_dir_writable(cfg.checkpoint.dir)
    _check_room_for_a_checkpoint(cfg, tensors)
    if resume:
        check_resume_layout(cfg.checkpoint.dir, cfg.parallel, world_size)
        check_resume(cfg)
    check_optimizer(cfg, resume=resume)
    for path, key in ((cfg.data.train_path, "data.train_path"), (cfg.eval.path, "eval.path")):
        if path is not None:  # the held-out set (eval.path) is read like the training set
            load_prompt_records(
                path,
                fmt=cfg.data.format,
                prompt_key=cfg.data.prompt_key,
                messages_key=cfg.data.messages_key,
                answer_key=cfg.data.answer_key,
                key=key,
            )
    # with the tokenizer: what the rollout would refuse after start-up
    tokenizer = check_prompts_fit(cfg)
    _check_reward(cfg.reward.kind)
    if cfg.rollout.env is not None:
        _check_module(cfg.rollout.env, "rollout.env")
    _check_engine_python(cfg)
    _check_topology(cfg, world_size)
    return tokenizer


def check_resume(cfg: Config) -> list[str]:
    """--resume: the checkpoint `latest` names was trained from this model, and no key its
    state is bound to changed; returns the changed keys (`key: old -> new`), which apply from
    the resumed step (the trainer prints them)."""
    if cfg.checkpoint.dir is None or (path := latest_checkpoint(cfg.checkpoint.dir)) is None:
        return []
    check_resume_model(path, cfg.model.hf_path)
    step = _checkpoint_step(path)
    require(
        step is None or cfg.train.steps >= step,
        f"train.steps={cfg.train.steps} is below the step of the checkpoint to resume ({path},"
        f" step {step}): the run would train nothing; set train.steps above {step}, or resume"
        " another checkpoint.dir",
    )
    return resume_config_changes(path, cfg.to_dict())


def check_optimizer(cfg: Config, *, resume: bool, built: list[str] | None = None) -> None:
    """With `checkpoint.dir`: the inner optimizer this run builds is one whose state the
    checkpoints save and resume (`patches.optimizer.STEP_LAYOUTS`), and with `resume` it keeps
    Adam's step where the checkpoint's did (its `OPTIMIZER_FILE`). Before any model is built
    the optimizer is the one megatron-core will pick for `optim.optimizer` among the installed
    packages (`planned_optimizer`; was: checked only once the model and optimizer had been
    built, and a checkpoint of another optimizer was met only by its load); after, `built`
    (`optimizer_classes` of the real one) checks the same again."""
    from megatron_gspo.patches import PatchError
    from megatron_gspo.patches.optimizer import check_resumable, planned_optimizer

    if not cfg.checkpoint.dir:
        return
    saved, where = None, ""
    if resume and (path := latest_checkpoint(cfg.checkpoint.dir)) is not None:
        saved, where = saved_optimizer_classes(path), str(path)
    try:
        check_resumable(built or [planned_optimizer(cfg.optim.optimizer)], saved, where)
    except PatchError as e:
        raise ConfigError(str(e)) from None


def _checkpoint_step(path: Path) -> int | None:
    """The step of a `step_<N>` checkpoint directory (None for another name)."""
    head, _, digits = path.name.partition("_")
    return int(digits) if head == "step" and digits.isdigit() else None


def check_run_dir(cfg: Config, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run where a previous one left metrics or checkpoints: appending a
    second run to metrics.jsonl and replacing its checkpoints silently loses the first."""
    if resume or overwrite:
        return
    found = previous_run_files(cfg)
    require(
        not found,
        f"{found[0] if found else ''}: a previous run is there; pass --resume to continue it, "
        "--overwrite to replace it, or set logging.dir / checkpoint.dir to a new directory",
    )


def _check_dir(path: str, key: str) -> Path:
    p = Path(path)
    require(p.exists(), f"{key}={path}: no such directory (a local Hugging Face model directory)")
    require(p.is_dir(), f"{key}={path}: not a directory (a local Hugging Face model directory)")
    return p


def read_hf_config(path: str, key: str) -> SimpleNamespace:
    """config.json of a Hugging Face model directory as attributes (what `Layout.validate`
    reads), or a ConfigError naming the directory and `key`. Hub names are not fetched: the job
    trains from a local directory (download it first)."""
    cfg_file = _check_dir(path, key) / "config.json"
    require(
        cfg_file.is_file(),
        f"{cfg_file}: missing; {key}={path} is not a Hugging Face model directory",
    )
    try:
        data = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{cfg_file}: not valid JSON ({e}); check {key}") from None
    require(isinstance(data, dict), f"{cfg_file}: not a JSON object; check {key}")
    return SimpleNamespace(**data)


def _check_room_for_a_checkpoint(cfg: Config, tensors: dict[str, Any]) -> None:
    """checkpoint.dir's file system has room for one checkpoint (estimated from the weight
    files' headers: fp32 parameters and optimizer state, a lower bound of what it writes)."""
    if not cfg.checkpoint.dir or not tensors:
        return
    need = estimate_checkpoint_bytes(tensors, cfg.optim.optimizer)
    path = Path(cfg.checkpoint.dir).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    require(
        free >= need,
        f"checkpoint.dir={cfg.checkpoint.dir}: {free / 2**20:.1f} MiB free on its file system, "
        f"one checkpoint takes at least {need / 2**20:.1f} MiB (estimated: fp32 weights and "
        f"{cfg.optim.optimizer} state); free space or change checkpoint.dir",
    )


def _check_driver(cfg: Config) -> None:
    """Where nvidia-smi exists but this torch cannot use the GPUs (a driver older than its
    CUDA build, or no GPU given to the job), say so before the job falls back to CPU and
    refuses `model.dtype` (issue 35, item 8). `train.device=cpu` asks for the CPU."""
    from megatron_gspo.plan.gpu_stack import driver_problem, nvidia_driver, torch_here

    if cfg.train.device == "cpu" or (driver := nvidia_driver()) is None:
        return
    problem = driver_problem(torch_here(), driver, "the trainer's interpreter")
    require(problem is None, problem or "")


def _check_dtype(cfg: Config) -> None:
    """megatron-core's CPU path runs fp32 and bf16 (fp32 main params), not fp16 (its loss
    scaler); make_provider says the same, but only after megatron-core has been initialised on
    every rank."""
    device = cfg.train.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    require(
        device != "cpu" or cfg.model.dtype != "fp16",
        "model.dtype=fp16 on CPU: fp16 needs a loss scaler and CPU kernels megatron-core lacks; "
        "set model.dtype=bf16 or fp32",
    )


def _check_topology(cfg: Config, world_size: int) -> None:
    """The launch-plan rules that can be seen from inside the job (`topology`): torchrun's
    LOCAL_WORLD_SIZE gives the trainer's node count (the planner checks the rest)."""
    from megatron_gspo.plan.topology import Placement, transport_problems

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    nodes = max(1, world_size // max(1, local))
    if nodes == 1 or cfg.weights.master_address is None:
        return
    problems = transport_problems(cfg, Placement(nodes=nodes, gpus_per_node=local))
    pinned = [p for p in problems if p.startswith("weights.master_address")]
    require(not pinned, pinned[0] if pinned else "")


def _check_engine_python(cfg: Config) -> None:
    """A real server without rollout.launch.python has an interpreter to run in (checked here,
    on every rank: only rank 0 launches engines, the others would wait for it in a collective).
    An explicit rollout.launch.python is taken as given: it names a path on the engine host."""
    check_engine_interpreter(cfg.rollout.launch)


def _check_reward(kind: str) -> None:
    """A user reward "module:function" must be importable. Located, not imported: user code
    runs in the reward workers only."""
    if kind in ("math", "toy", "pattern", "http"):  # http: a server, reached at the first step
        return
    _check_module(kind, "reward.kind")


def _check_module(kind: str, key: str) -> None:
    """The module of "module:attr" can be found (located, not imported)."""
    module = kind.partition(":")[0]
    try:
        spec: importlib.machinery.ModuleSpec | None = importlib.util.find_spec(module)
    except (ImportError, ValueError) as e:  # a missing parent package, or a malformed name
        spec, why = None, str(e)
    else:
        why = f"no module named {module!r}"
    require(
        spec is not None,
        f"{key}={kind!r}: cannot import it ({why}) from the working directory or "
        f"PYTHONPATH; change {key} or PYTHONPATH",
    )
