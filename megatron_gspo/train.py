"""GSPO training: `torchrun --nproc_per_node N -m megatron_gspo.train --config FILE [--set k=v]`.

One step: rollout (rank 0: G responses per prompt with the engine's log-probs) -> rewards ->
group advantages -> broadcast -> mini-batch updates on Megatron (every rank) -> push the new
weights to the engines -> log -> checkpoint. Algorithm choice lives in the config only.
"""

from __future__ import annotations

from megatron_gspo.run.interrupt import quiet_ctrl_c

if __name__ == "__main__":  # Ctrl-C inside the imports below: one line (the console script's
    quiet_ctrl_c("megatron_gspo.train")  # entry does the same: megatron_gspo/entry.py)

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from megatron_gspo import dist
from megatron_gspo.config import Config, ConfigError, dump_config, parse_cli
from megatron_gspo.engines.protocols import NoEnginesLeft
from megatron_gspo.rollout.evaluation import build_evaluator
from megatron_gspo.run import faults
from megatron_gspo.run.console import (
    route_third_party_output,
    survive_a_lost_console,
    third_party_stdio,
)
from megatron_gspo.run.metrics_log import MetricsLogger
from megatron_gspo.run.preflight import check_optimizer, check_resume, preflight
from megatron_gspo.run.run_dir import RunLock, clear_previous_run
from megatron_gspo.run.stop import StopSignals
from megatron_gspo.run.user_errors import build_policy, exit_code, first_push
from megatron_gspo.weights.colocated import resume_engines
from megatron_gspo.weights.owners import send_engines_for
from megatron_gspo.weights.sync import WeightSync

if TYPE_CHECKING:  # imported in main(), after third-party output is routed to the log file
    from collections.abc import Callable

    from megatron_gspo.data.tokenizer import Tokenizer
    from megatron_gspo.engines.nodes import LaunchedEngines, PendingEngines
    from megatron_gspo.megatron.policy import Policy
    from megatron_gspo.rollout.evaluation import Evaluator
    from megatron_gspo.rollout.experience import Rollout
    from megatron_gspo.weights.sync import SyncReport


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient (train.max_bad_steps)."""


class RewardsFailing(TrainingDiverged):
    """Every reward call failed in train.max_failed_reward_steps consecutive steps."""


class WeightsNotFinite(TrainingDiverged):
    """A parameter is inf or NaN after an update (or as loaded): stopped before any push or
    save, so neither the engines nor a checkpoint ever hold such weights."""


def main(argv: list[str] | None = None) -> None:
    """Raises `ConfigError` for bad input (`cli` prints it as one line, exit code 2)."""
    cfg, args = parse_cli(argv)
    if args.dump:
        print(dump_config(cfg), end="")
        return
    changed, tokenizer = _check_input(cfg, overwrite=args.overwrite)
    stop, lock = _start_process(cfg)
    cfg = with_routes(cfg)
    run = _Parts(tokenizer=tokenizer)
    try:  # whatever fails, engines and reward workers are shut down
        _train(cfg, run, stop, overwrite=args.overwrite, changed=changed)
    finally:
        run.close()
        if lock is not None:
            lock.release()
    torch.distributed.destroy_process_group()


def _check_input(cfg: Config, *, overwrite: bool) -> tuple[list[str], Tokenizer]:
    """Every rank, before anything is started or written: a bad input ends all ranks alike.
    Returns the keys a resume changes (refused ones raised in preflight) and the tokenizer
    preflight loaded (rank 0's rollout takes it rather than loading it again)."""
    tokenizer = preflight(
        cfg,
        resume=cfg.checkpoint.resume,
        overwrite=overwrite,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )
    return (check_resume(cfg) if cfg.checkpoint.resume else []), tokenizer


def _start_process(cfg: Config) -> tuple[StopSignals, RunLock | None]:
    """This rank's process: third-party output to the log, stop signals, the process group,
    the run directories' lock, and the checkpoint to resume verified before anything starts."""
    # Library chatter (import-time tracebacks, deprecations, loading bars) goes to
    # <logging.dir>/third_party.log; the console keeps our progress bar and messages.
    route_third_party_output(cfg.logging.dir)
    # SIGTERM / Ctrl-C from here on: a checkpoint at the next step boundary, every rank gone
    # within train.stop_grace_s (megatron_gspo/run/stop.py).
    stop = StopSignals(cfg.train.stop_grace_s).install()
    survive_a_lost_console()  # a closed terminal: the step goes on to its checkpoint
    dist.init_distributed(cfg.train.device, timeout_s=cfg.train.dist_timeout_s)
    lock = lock_run_dirs(cfg)  # one run at a time in logging.dir / checkpoint.dir
    if cfg.checkpoint.resume and cfg.checkpoint.dir:  # a damaged checkpoint: before any start
        from megatron_gspo.checkpoint.store import latest_checkpoint, verify

        if (path := latest_checkpoint(cfg.checkpoint.dir)) is not None:
            verify(path)
    return stop, lock


def with_routes(cfg: Config) -> Config:
    """rl.routing_replay (a study control): the run whose engines return the routes of the
    model's top-k experts (launch flag and client request, from the model's config.json); a
    new `Config`, resolved before any engine starts. Without it, `cfg` itself."""
    if not cfg.rl.routing_replay:
        return cfg
    from megatron_gspo.engines.routed_experts import ask_for_routes, model_topk

    launch, client = ask_for_routes(
        cfg.rollout.launch, cfg.rollout.client, model_topk(cfg.model.hf_path)
    )
    rollout = dataclasses.replace(cfg.rollout, launch=launch, client=client)
    return dataclasses.replace(cfg, rollout=rollout)


@dataclass
class _Parts:
    """What a run has started, closed in order whatever fails."""

    tokenizer: Tokenizer | None = None
    """The run's tokenizer, as preflight loaded it (handed to the rollout)."""
    pending: PendingEngines | None = None
    """Engines starting (`engines.nodes.begin_node_engines`), not yet waited for."""
    launched: LaunchedEngines | None = None
    """This node's started engines."""
    rollout: Rollout | None = None
    sync: WeightSync | None = None
    log: MetricsLogger | None = None
    evaluator: Evaluator | None = None

    def close(self) -> None:
        for part in (self.log, self.evaluator, self.rollout, self.sync):
            if part is not None:
                part.close()
        launched = self.launched
        if self.rollout is None and launched is not None and launched.servers is not None:
            launched.servers.shutdown()  # another node's engines (rank 0's close with it)
        if self.pending is not None:  # the start failed before the engines were waited for
            self.pending.shutdown()


def _train(
    cfg: Config, run: _Parts, stop: StopSignals, *, overwrite: bool, changed: list[str]
) -> None:
    """Engines, policy, rollout, weight sync, resume, metrics; then the loop."""
    launch = cfg.rollout.launch
    # Engines that do not share the trainer's devices start now and import / load while the
    # model is built; colocated ones after it (they size their memory from what is left).
    if launch is not None and not launch.colocated:
        run.pending = _begin_engines(cfg)
    policy = _build_policy(cfg)
    _start_rollout(cfg, run)
    send = send_engines_for(cfg.weights, cfg.rollout.client, run.launched)  # senders=owners
    run.sync = WeightSync(
        policy.bridge, run.rollout.engine if run.rollout else [], cfg.weights, send_engines=send
    )
    start = _resume(cfg, policy, run.rollout, overwrite=overwrite, changed=changed)
    run.log = MetricsLogger.from_config(
        cfg.logging,
        total_steps=cfg.train.steps,
        config=cfg.to_dict(),
        rank=dist.rank(),
        start_step=start,
    )
    evaluate = run.evaluator.maybe_run if run.evaluator else (lambda step: {})
    _loop(cfg, policy, run.rollout, run.sync, run.log, start, stop, evaluate)


def _build_policy(cfg: Config) -> Policy:
    """The policy on every rank; a checkpoint it could not resume from is refused before any
    engine serves."""
    with third_party_stdio(cfg.logging.dir):
        policy = build_policy(cfg.policy_spec())  # weights that do not fit config.json: one line
    from megatron_gspo.patches.optimizer import optimizer_classes

    # preflight decided this from the optimizer megatron-core would pick; the built one decides
    check_optimizer(cfg, resume=cfg.checkpoint.resume, built=optimizer_classes(policy.optimizer))
    return policy


def _start_rollout(cfg: Config, run: _Parts) -> None:
    """Each node's local rank 0 starts its engines; rank 0 connects its rollout (and the
    evaluator, eval.every) to them."""
    from megatron_gspo.rollout.experience import make_rollout

    spec = cfg.rollout_spec()
    with third_party_stdio(cfg.logging.dir):
        if cfg.rollout.launch is not None:
            run.pending = run.pending or _begin_engines(cfg)
            run.launched = run.pending.wait()
            run.pending = None
        if dist.rank() == 0:
            run.rollout = make_rollout(spec, run.launched, tokenizer=run.tokenizer)
        run.evaluator = build_evaluator(spec, run.rollout)  # None when off and off rank 0


def _resume(
    cfg: Config, policy: Policy, rollout: Rollout | None, *, overwrite: bool, changed: list[str]
) -> int:
    """The step to start from: the checkpoint's (checkpoint.resume), else 0; --overwrite clears
    the previous run only now that the new one has started."""
    from megatron_gspo.checkpoint.store import load_checkpoint

    start = load_checkpoint(cfg, policy, rollout) if cfg.checkpoint.resume else 0
    if overwrite and dist.rank() == 0:
        clear_previous_run(cfg)
    if start and changed and dist.rank() == 0:
        print(
            f"[train] resumed at step {start} with a changed config, applied from step "
            f"{start + 1} on: {'; '.join(changed)}",
            file=sys.stderr,
            flush=True,
        )
    return start


def _begin_engines(cfg: Config) -> PendingEngines:
    from megatron_gspo.engines.nodes import begin_node_engines

    assert cfg.rollout.launch is not None
    logs = Path(cfg.logging.dir) / "engines"
    return begin_node_engines(cfg.rollout.launch, cfg.rollout.client, logs)


def _loop(
    cfg: Config,
    policy: Policy,
    rollout: Rollout | None,
    sync: WeightSync,
    log: MetricsLogger,
    start: int,
    stop: StopSignals,
    evaluate: Callable[[int], dict[str, float]],
) -> None:
    from megatron_gspo.megatron.offload import offload_trainer, reload_trainer
    from megatron_gspo.megatron.transfer import broadcast_sequences

    colocated_job = bool(cfg.rollout.launch and cfg.rollout.launch.colocated)  # every rank
    colocated = bool(rollout) and colocated_job
    push = _pusher(policy, rollout, sync)
    _check_weights_finite(cfg, policy, start, None)  # as loaded: before they are first pushed
    # The engines serve exactly the trainer's weights from step 0; a verified push that fails
    # here means they serve another model (user_errors.first_push: one line naming both).
    first_push(push, cfg, [rollout.engine] if rollout else [])
    if start == 0 and (held_out := evaluate(0)):  # the held-out curve starts untrained
        log.log(0, held_out)
    bad = 0  # consecutive steps with a skipped (non-finite) update
    no_reward = 0  # consecutive steps in which every reward call failed
    for step in range(start, cfg.train.steps):
        t0 = time.perf_counter()
        offload_trainer(policy)  # colocated: trainer state off the devices while engines run
        seqs, metrics, lost = _collect(rollout)
        faults.point("rollout", step + 1)  # tests only: MGSPO_FAULT
        if rollout and colocated and lost is None:  # before the broadcast, so no rank reloads
            rollout.engine.release_memory()  # into engine memory
        # The sequences as tensors, the metrics and the stop reason pickled (small).
        seqs, (metrics, lost) = broadcast_sequences(seqs, (metrics, lost))
        if lost is not None or seqs is None:  # every engine is gone: keep what `step` trained
            reload_trainer(policy)
            _stop_without_engines(cfg, policy, rollout, step, lost or "no rollout")
        t1 = time.perf_counter()
        metrics |= reload_trainer(policy)
        faults.point("backward", step + 1, policy.model)
        metrics |= policy.update(seqs, step)
        faults.point("update", step + 1, policy.model)  # tests only: MGSPO_FAULT
        # Whatever made them so, non-finite weights stop the step before any push or save.
        _check_weights_finite(cfg, policy, step + 1, metrics)
        t2 = time.perf_counter()
        # Every rank frees its cached blocks, then rank 0 resumes the engines' memory.
        resume_engines(rollout.engine if rollout else None, colocated=colocated_job)
        try:
            pushed = push()
        except NoEnginesLeft as e:  # raised on every rank alike; the update itself is sound
            log.log(step + 1, metrics)
            _stop_without_engines(cfg, policy, rollout, step + 1, str(e))
        metrics |= _step_metrics(pushed, seqs, t0, t1, t2)
        metrics |= evaluate(step + 1)  # eval.every: held-out prompts on the pushed weights
        log.log(step + 1, metrics)
        bad = bad + 1 if metrics["train/skipped_updates"] else 0
        no_reward = no_reward + 1 if metrics.get("reward/failed_frac", 0.0) >= 1.0 else 0
        rewards_gone = 0 < cfg.train.max_failed_reward_steps <= no_reward
        every = cfg.checkpoint.save_every
        stopping = stop.agreed()  # collective: a signal on any rank stops every rank here
        last = stopping or bad >= cfg.train.max_bad_steps or step + 1 == cfg.train.steps
        last = last or rewards_gone
        if cfg.checkpoint.dir and (last or (every and (step + 1) % every == 0)):
            from megatron_gspo.checkpoint.store import save_checkpoint

            save_checkpoint(cfg, policy, rollout, step + 1)
        if bad >= cfg.train.max_bad_steps:
            raise TrainingDiverged(
                f"{bad} consecutive steps (up to step {step + 1}) had a non-finite loss or "
                f"gradient norm and were skipped (train.max_bad_steps={cfg.train.max_bad_steps});"
                f" {_saved(cfg, step + 1)}. Lower optim.lr, check the data and "
                "rewards, or resume from an earlier checkpoint."
            )
        if rewards_gone:
            errors = "; ".join(rollout.reward_errors[:2]) if rollout else ""
            raise RewardsFailing(
                f"every reward call failed in {no_reward} consecutive steps (up to step "
                f"{step + 1}; train.max_failed_reward_steps="
                f"{cfg.train.max_failed_reward_steps}): each scored 0, so nothing was learned; "
                f"{_saved(cfg, step + 1)}. Fix reward.kind ({cfg.reward.kind})"
                + (f"; first errors: {errors}" if errors else "")
            )
        if stopping:
            why = stop.requested or "stop requested on another rank"
            print(f"[train] {why}: {_saved(cfg, step + 1)}", file=sys.stderr, flush=True)
            return
    if cfg.checkpoint.export_hf_at_end:
        from megatron_gspo.weights.convert import export_hf

        out = f"{cfg.checkpoint.dir}/hf_final"
        export_hf(policy.bridge, policy.model, out, hf_dir=cfg.model.hf_path)


def lock_run_dirs(cfg: Config) -> RunLock | None:
    """Collective: rank 0 locks the run directories; a refusal reaches every rank alike (a
    ConfigError, exit code 2), so no rank waits for a peer that has left."""
    lock, error = None, None
    if dist.rank() == 0:
        try:
            lock = RunLock.acquire(cfg)
        except ConfigError as e:
            error = str(e)
    error = dist.broadcast(error)
    if error is not None:
        raise ConfigError(error)
    return lock


def _check_weights_finite(
    cfg: Config, policy: Policy, step: int, metrics: dict[str, float] | None
) -> None:
    """Collective: raise `WeightsNotFinite` (every rank alike) naming the first non-finite
    parameter, what made it so and the last checkpoint, which is from before it."""
    from megatron_gspo.checkpoint.store import latest_checkpoint
    from megatron_gspo.megatron.step import nonfinite_params

    where = nonfinite_params(policy.model)
    if where is None:
        return
    if metrics is None:
        what = f"as loaded at step {step}"
        cause = "the model directory or the checkpoint holds them; check model.hf_path"
    else:
        what = f"after the update of step {step}"
        finite = all(math.isfinite(metrics.get(k, math.nan)) for k in ("loss", "grad_norm"))
        if finite and not metrics.get("train/skipped_updates"):
            cause = (
                "the loss and gradient norm were finite, so the optimizer update itself "
                f"overflowed (optim.lr={cfg.optim.lr}); lower optim.lr"
            )
        else:
            cause = "a non-finite loss or gradient preceded it; check the data and rewards"
    latest = latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    kept = f"the last checkpoint, {latest}, is from before it" if latest else "no checkpoint"
    raise WeightsNotFinite(
        f"the weights are not finite {what} ({where}): {cause}. Nothing of it was pushed to "
        f"the engines or saved; {kept}"
    )


def _collect(rollout: Rollout | None) -> tuple[Any, Any, str | None]:
    """Rank 0's rollout, with `NoEnginesLeft` returned as its message so that every rank
    learns of it through the broadcast that follows."""
    if rollout is None:
        return None, None, None
    try:  # the unused prompts stay in the rollout's checkpoint state
        seqs, metrics = rollout.next_batch()
    except NoEnginesLeft as e:
        return None, None, str(e)
    return seqs, metrics, None


def _stop_without_engines(
    cfg: Config, policy: Policy, rollout: Rollout | None, step: int, why: str
) -> NoReturn:
    """Checkpoint the state after `step` trained steps (every rank), then stop."""
    if cfg.checkpoint.dir:
        from megatron_gspo.checkpoint.store import save_checkpoint

        save_checkpoint(cfg, policy, rollout, step)
    raise NoEnginesLeft(f"{why}; {_saved(cfg, step)}")


def _pusher(policy: Policy, rollout: Rollout | None, sync: WeightSync) -> Callable[[], SyncReport]:
    """`push()`: the weight sync (every rank), with rank 0's rollout paused around it (async
    mode: in-flight requests stop and continue on the new weights)."""

    def push() -> SyncReport:
        if rollout:
            rollout.before_push()
        pushed = sync.push(policy.model)
        if rollout:
            rollout.after_push(pushed.version)
        return pushed

    return push


def _saved(cfg: Config, step: int) -> str:
    if cfg.checkpoint.dir:
        return f"checkpoint written at step {step} in {cfg.checkpoint.dir}"
    return "no checkpoint written (checkpoint.dir is not set)"


def _step_metrics(
    pushed: SyncReport, seqs: list, t0: float, t1: float, t2: float
) -> dict[str, float]:
    return {
        "weights/version": pushed.version,
        "weights/verified": float(pushed.verified),
        "weights/gb_per_s": pushed.gb_per_s,
        "time/train_s": t2 - t1,
        "time/sync_s": time.perf_counter() - t2,
        "time/step_s": time.perf_counter() - t0,
        "perf/tokens_per_s": sum(s.length for s in seqs) / (t2 - t1),
    }


def _hold_stop_signals() -> None:
    """Block the stop signals for the rest of this process: it is exiting with its one line
    already, and a launcher that ends it now (torchrun, once another rank exited) must not add
    a "stopping after this step" line or change its exit code."""
    import signal

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def cli() -> None:
    """The entry point: `main`, each documented failure as one line and its exit code, and the
    rank's end in order (`teardown.end_process`: process groups and their threads first)."""
    from megatron_gspo.run.teardown import end_process

    try:
        main(sys.argv[1:])
    except ConfigError as e:  # bad input (DatasetError included): one line, no traceback
        _hold_stop_signals()  # torchrun ending this rank now adds no "[train] SIGTERM" line
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        end_process(2)
    except (TrainingDiverged, NoEnginesLeft) as e:  # checkpointed first; exit 3 / 4
        if dist.rank() == 0:
            print(f"[train] stopped: {e}", file=sys.stderr, flush=True)
        end_process(3 if isinstance(e, TrainingDiverged) else 4)
    except Exception as e:  # the other documented kinds (user_errors.EXIT_CODES): one line
        if (code := exit_code(e)) is None:
            raise
        _one_line_exit(e, code)
    end_process(0)


def _one_line_exit(e: BaseException, code: int) -> NoReturn:
    """Rank 0 prints `e` as one line (every rank raises it alike); exit with `code`."""
    from megatron_gspo.run.teardown import end_process

    _hold_stop_signals()
    if dist.rank() == 0:
        text = " ".join(str(e).split())
        print(f"error: {type(e).__name__}: {text}", file=sys.stderr, flush=True)
    end_process(code)


if __name__ == "__main__":
    cli()
