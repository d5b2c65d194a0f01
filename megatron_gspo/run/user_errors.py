"""Faults a new user meets, turned from a multi-rank traceback into one line and an exit code.

`train.cli` prints the message of each exception below on rank 0 as one line and exits with
the code of its kind (`EXIT_CODES`; `docs/reliability.md` lists them):

* 2: bad input (`ConfigError`): a config, model directory or engine that does not fit the run
* 3: training cannot go on, checkpoint written first: non-finite steps
  (`train.max_bad_steps`), every reward call failing (`train.max_failed_reward_steps`); or
  weights that an update made non-finite (`WeightsNotFinite`, `UpdateOverflow`): stopped
  before any push or save, the last checkpoint is from before that step
* 4: no rollout engine left, checkpoint written first
* 5: a checkpoint could not be written (`CheckpointWriteError`)
* 6: a weight sync after the first failed (`WeightSyncError`, `WeightIntegrityError`)
* 130: Ctrl-C / SIGTERM (`stop.py`, `interrupt.py`)

Two translations happen where the cause is known:

* `build_policy`: a model directory whose weights lack a tensor (megatron-bridge's `KeyError:
  Keys not found in safetensors`) or hold one of another shape is bad input.
* `first_push`: the weight sync before step 1 failing (a tensor of another shape refused by
  the engine, a checksum that differs, a parameter the engine holds that the push did not
  write, one it lacks) means the engine serves another model than `model.hf_path`: bad input,
  naming both models. Where every engine reports a checkpoint of this run, the message names
  the engines' layout instead (a TP size the trainer does not expect, say).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from megatron_gspo.config_io import ConfigError

if TYPE_CHECKING:
    from megatron_gspo.config import Config
    from megatron_gspo.megatron.config import PolicySpec
    from megatron_gspo.megatron.policy import Policy

__all__ = ["EXIT_CODES", "EngineModelMismatch", "build_policy", "exit_code", "first_push"]

EXIT_CODES = {
    "ConfigError": 2,
    "DatasetError": 2,
    "EngineModelMismatch": 2,
    "TrainingDiverged": 3,
    "RewardsFailing": 3,
    "WeightsNotFinite": 3,
    "UpdateOverflow": 3,
    "NoEnginesLeft": 4,
    "CheckpointWriteError": 5,
    "WeightSyncError": 6,
    "WeightIntegrityError": 6,
}


def exit_code(e: BaseException) -> int | None:
    """The documented exit code of `e`'s kind (its class or a base class), None if none."""
    for cls in type(e).__mro__:
        if cls.__name__ in EXIT_CODES:
            return EXIT_CODES[cls.__name__]
    return None


class EngineModelMismatch(ConfigError):
    """The rollout engines serve another model than the trainer's (bad input: exit code 2)."""


def build_policy(cfg: PolicySpec, build: Callable[[PolicySpec], Policy] | None = None) -> Policy:
    """`Policy.build(cfg)` (or `build(cfg)`; `cfg`: a `PolicySpec`), with a model directory
    whose weights do not fit its config.json (a missing tensor, a tensor of another shape) as
    one ConfigError naming the directory."""
    if build is None:
        from megatron_gspo.megatron.policy import Policy

        build = Policy.build
    hf = cfg.model.hf_path
    try:
        return build(cfg)
    except KeyError as e:  # megatron-bridge: "Keys not found in safetensors ...: {names}"
        text = str(e.args[0]) if e.args else str(e)
        if "not found" not in text:
            raise
        names = text[text.rfind("{") :] if "{" in text else text
        raise ConfigError(
            f"model.hf_path={hf}: its weight files lack tensors its config.json needs: "
            f"{names[:300]}; use a complete model directory, or model.load_weights=false to "
            "start from random weights"
        ) from None
    except RuntimeError as e:  # torch's copy_: "The size of tensor a (64) must match ..."
        if "size of tensor" not in str(e) and "shape" not in str(e):
            raise
        raise ConfigError(
            f"model.hf_path={hf}: a tensor in its weight files has another shape than its "
            f"config.json gives ({str(e).splitlines()[0][:200]}); use a consistent model "
            "directory"
        ) from None


@runtime_checkable
class ServesModels(Protocol):
    """What `first_push` asks an engine that has it (`SGLangClient`): each server's model."""

    def model_paths(self) -> dict[str, str]: ...


def _served_paths(engines: Sequence[object]) -> dict[str, str]:
    found: dict[str, str] = {}
    for engine in engines:
        if not isinstance(engine, ServesModels):
            continue
        try:
            found |= engine.model_paths()
        except Exception:  # noqa: BLE001 - the message names what it can
            continue
    return found


def _describe(found: dict[str, str]) -> str:
    if not found:
        return "the engines' model is unknown (no /model_info)"
    return ", ".join(f"{url} serves {path}" for url, path in sorted(found.items()))


def _trainer_paths(cfg: Config) -> set[str]:
    """Where engines of this run may start from: model.hf_path, or the engines' own checkpoint
    (rollout.launch.model_path, e.g. block FP8)."""
    paths = {cfg.model.hf_path}
    launch = getattr(getattr(cfg, "rollout", None), "launch", None)
    if launch is not None and getattr(launch, "model_path", None):
        paths.add(launch.model_path)
    return {os.path.realpath(str(p)) for p in paths if p}


def first_push[T](push: Callable[[], T], cfg: Config, engines: Sequence[object]) -> T:
    """The weight sync before step 1 (every rank); its failure as an `EngineModelMismatch`
    naming the trainer's model and each engine's. Where every engine reports a checkpoint of
    this run, the engines' layout (not their model) is named as what to check."""
    from megatron_gspo.weights.checksum import WeightIntegrityError
    from megatron_gspo.weights.sync import WeightSyncError

    try:
        return push()
    except (WeightIntegrityError, WeightSyncError) as e:
        why = str(e).splitlines()[0][:400]
        found = _served_paths(engines)
        ours = _trainer_paths(cfg)
        if found and all(os.path.realpath(p) in ours for p in found.values()):
            raise EngineModelMismatch(
                f"the first weight sync failed although the engines serve this run's model "
                f"({_describe(found)}): {why}. Check that rollout.launch.tp_size / ep_size "
                "(or rollout.client.engine_tp_sizes) match how the engines were started"
            ) from None
        raise EngineModelMismatch(
            f"the rollout engines serve another model than the trainer: "
            f"{_describe(found)}; the trainer has model.hf_path={cfg.model.hf_path} "
            f"(first weight sync: {why}). Start the engines from model.hf_path, or point "
            "rollout.client.engine_urls at engines that serve it"
        ) from None
