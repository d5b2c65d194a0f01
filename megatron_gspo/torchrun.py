"""torchrun, with the job's promise on bad input: one line and exit code 2.

    python -m megatron_gspo.torchrun --nproc_per_node 8 -m megatron_gspo.train --config my.yaml

takes torchrun's own arguments (its parser) and differs in two ways:

* for `-m megatron_gspo.train`, the trainer's input checks (`config.parse_cli` + `preflight`:
  config, paths, the run directory and its lock, data, model, layout) run once here, before any
  worker starts: a bad input prints `error: <one line>` and exits 2 at once;
* when a worker fails, the exit code is that worker's (2 bad input, 3 diverged, 4 no engine
  left, 128+N for a signal) instead of torchrun's 1, and torchrun's ~40-line
  `ChildFailedError` report and traceback are replaced by one line (none for code 2, whose
  line the rank already printed); a signal that torchrun forwarded to the ranks (SIGTERM,
  SIGINT, SIGHUP: they stop with a checkpoint) ends it with 128+N instead of a traceback.

Plain `torchrun ... -m megatron_gspo.train` still works: the rank prints the same one line,
but torchrun then adds its report and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

__all__ = ["main"]

TRAINER = "megatron_gspo.train"
BAD_INPUT_EXIT_CODE = 2


def _world_size(args: argparse.Namespace) -> int | None:
    """nnodes x nproc_per_node when both are fixed numbers (else the ranks check the layout)."""
    try:
        nproc = int(args.nproc_per_node)
        nnodes = str(args.nnodes)
        low, _, high = nnodes.partition(":")
        if high and high != low:
            return None
        return int(low) * nproc
    except (TypeError, ValueError):
        return None


def check_trainer_input(train_argv: list[str], world_size: int | None) -> str | None:
    """The trainer's input checks, in this process; the one-line message of a refusal."""
    from megatron_gspo.config import ConfigError, parse_cli
    from megatron_gspo.run.preflight import preflight

    try:
        cfg, args = parse_cli(train_argv)
        if args.dump or world_size is None:
            return None
        preflight(
            cfg, resume=cfg.checkpoint.resume, overwrite=args.overwrite, world_size=world_size
        )
    except ConfigError as e:
        return str(e)
    return None


def exit_code_of(failure: object) -> int:
    """A failed worker's exit code as a shell reports it (128+N for signal N)."""
    code = int(getattr(failure, "exitcode", 1) or 1)
    return 128 - code if code < 0 else code


def _quiet_worker_failure_records() -> None:
    # torchrun's agent logs "failed (exitcode: 2) local_rank: 0 ... of binary: ..." for a worker
    # that exits non-zero, and "Sending process N closing signal SIGTERM" as it ends the others;
    # the one line printed below (or by the rank) says it instead.
    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            text = record.getMessage()
            return "failed (exitcode" not in text and "closing signal" not in text

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_Drop())


def _keep_launcher_output(train_argv: list[str] | None) -> None:
    """What torchrun itself logged (its OMP_NUM_THREADS notice, ...), held in memory while the
    ranks ran: appended to the trainer's `<logging.dir>/third_party.log` once they ended (the
    ranks own that directory while they run, and a refused start writes nothing); for another
    script, with no log directory known, dropped."""
    from megatron_gspo.run.console import release_held_output

    text = release_held_output()
    if not text or train_argv is None:
        return
    from megatron_gspo.config import ConfigError, parse_cli
    from megatron_gspo.run.console import THIRD_PARTY_LOG

    try:
        log_dir = Path(parse_cli(train_argv)[0].logging.dir)
    except ConfigError:
        return
    if log_dir.is_dir():
        with (log_dir / THIRD_PARTY_LOG).open("a", encoding="utf-8") as f:
            f.write(text)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import get_args_parser, run

    from megatron_gspo.run.console import hold_third_party_output, release_held_output

    args = get_args_parser().parse_args(argv)
    train_argv = None
    if args.module and args.training_script == TRAINER:
        train_argv = list(args.training_script_args)
        error = check_trainer_input(train_argv, _world_size(args))
        if error is not None:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return BAD_INPUT_EXIT_CODE
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _quiet_worker_failure_records()
    hold_third_party_output()  # torchrun's notices off the console (the ranks print their own)
    try:
        return _run(run, args, SignalException, ChildFailedError)
    except Exception:  # a bug of the launcher: its traceback after what it logged before
        sys.stderr.write(release_held_output())
        raise
    finally:
        _keep_launcher_output(train_argv)


def _run(
    run: Callable[[argparse.Namespace], object],
    args: argparse.Namespace,
    signal_exception: type[SignalException],
    child_failed: type[ChildFailedError],
) -> int:
    """torchrun's `run`, its ends as exit codes: 128+N for a forwarded signal, a failed
    worker's own code (and one line naming it, unless it was a refusal: code 2)."""
    try:
        run(args)
    except signal_exception as e:  # SIGTERM / SIGINT / SIGHUP: forwarded; the ranks checkpointed
        return 128 + int(e.sigval)
    except child_failed as e:
        rank, failure = e.get_first_failure()
        code = exit_code_of(failure)
        if code != BAD_INPUT_EXIT_CODE:  # a refusal's line is already on the console
            print(
                f"[torchrun] rank {rank} (pid {failure.pid}) exited with code {code}; its "
                "output above says why",
                file=sys.stderr,
                flush=True,
            )
        return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
