"""What the planner checks before it writes launch files (`--emit-launch`): the things a GPU job
would otherwise find out only after its engines became healthy, which can take most of an hour.

* weights in every model directory the trainer and the engines load (`model_files`);
* an engine interpreter that can run an SGLang server (given, never the trainer's by default);
* an interpreter that has `sglang_router` for the router (the engine venv has none);
* on a GPU node (`nvidia-smi` present): both interpreters' torch can use the driver;
* with `weights.transport=distributed`: both interpreters load one NCCL version.

Each problem is one line naming what to change; the planner prints them as refusals (exit 2)
and starts nothing. The planner runs with both interpreters at hand (the trainer's is this
process's), so each is asked directly (`gpu_stack.probe`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from megatron_gspo.config import Config
from megatron_gspo.engines.interpreter import (
    ENGINE_MODULES,
    ROUTER_MODULE,
    engine_interpreter_problem,
    router_problem,
    router_python,
)
from megatron_gspo.plan.gpu_stack import driver_problem, nccl_problem, nvidia_driver, probe
from megatron_gspo.plan.model_files import model_files_problem

__all__ = ["LaunchCheck", "launch_check"]

PACKAGE = "megatron_gspo"
"""What the engines import our SGLang loader from (`engines.sglang_loader`)."""


@dataclass
class LaunchCheck:
    """The verdict of `launch_check`."""

    problems: list[str] = field(default_factory=list)
    """One line each; empty: the launch files may be written."""
    router_python: str | None = None
    """The interpreter to start sglang-router with (disaggregated jobs)."""
    engine_loader: bool = True
    """Whether the engines' interpreter finds this package, so the engines get our expert
    slice loader (`engines.sglang_loader`, `--custom-weight-loader`); without it they are
    started without it and pushes send whole parameters (`weights.expert_slices`)."""
    notes: list[str] = field(default_factory=list)
    """Lines the planner prints that change nothing it refuses."""


def launch_check(
    cfg: Config,
    *,
    engine_python: str | None,
    rollout_nodes: int,
    trainer_python: str = sys.executable,
) -> LaunchCheck:
    """Check what the Slurm scripts are about to start (see the module doc)."""
    out = LaunchCheck()
    launch = cfg.rollout.launch
    if cfg.model.load_weights:
        out.problems.append(model_files_problem(cfg.model.hf_path) or "")
    if launch is not None and launch.model_path and launch.model_path != cfg.model.hf_path:
        key = "rollout.launch.model_path"
        out.problems.append(model_files_problem(launch.model_path, key) or "")
    out.problems = [p for p in out.problems if p]
    engine_python = engine_python or (launch.python if launch is not None else None)
    if not engine_python:
        out.problems.append(
            "no interpreter for the SGLang engines: pass --engine-python (the Slurm scripts: "
            "ENGINE_PYTHON, default the venv of bash scripts/engine_env.sh) or set "
            "rollout.launch.python; the trainer's venv cannot run a server"
        )
        return out
    try:
        engine = probe(engine_python, (*ENGINE_MODULES, ROUTER_MODULE, PACKAGE))
        trainer = (
            engine if trainer_python == engine_python else probe(trainer_python, (ROUTER_MODULE,))
        )
    except OSError as e:
        out.problems.append(f"the engines' interpreter: {e}; check ENGINE_PYTHON / --engine-python")
        return out
    if p := engine_interpreter_problem(engine_python, engine["modules"]):
        out.problems.append(p)
    out.engine_loader = bool(engine["modules"].get(PACKAGE))
    if not out.engine_loader:
        out.notes.append(
            f"the engines' interpreter {engine_python} cannot import {PACKAGE}: the engines "
            "start without our expert-slice loader and owners pushes gather each engine "
            f"rank's experts first (export PYTHONPATH=<this checkout> in the job to use it)"
        )
    if rollout_nodes:
        found = {
            engine_python: engine["modules"][ROUTER_MODULE],
            trainer_python: trainer["modules"][ROUTER_MODULE],
        }
        out.router_python = router_python(found)
        if out.router_python is None:
            out.problems.append(router_problem(list(found)))
    driver = nvidia_driver()
    for who, info in (("the trainer's interpreter", trainer), ("the engines' interpreter", engine)):
        if p := driver_problem(info, driver, who):
            out.problems.append(p)
            break  # one line: the same driver fails both the same way
    distributed = rollout_nodes > 0 or cfg.weights.transport == "distributed"
    if distributed and (p := nccl_problem(trainer, engine)):
        out.problems.append(p)
    return out
