"""The metrics sink: a JSONL line per step, TensorBoard scalars, optional W&B, a console line.

Only global rank 0 writes; on other ranks every method is a no-op, so the loop can call it
unconditionally. (Named `metrics_log` so that it never shadows the standard `logging` module.)

    with MetricsLogger.from_config(cfg.logging, total_steps=cfg.train.steps) as m:
        m.log(step, {"reward/mean": 0.3, "policy/clip_frac": 0.01, ...})

JSONL format (`<dir>/metrics.jsonl`): `{"step": int, "time": unix seconds, <key>: number, ...}`,
one object per line, flushed each step, appended across resumes (a reader keeps the last line of
a repeated step). Non-finite values are written as Python's json does (NaN / Infinity), which
`json.loads` reads back.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CONSOLE_KEYS", "MetricsLogger", "global_rank", "to_scalars"]

# Shown on the console when present (the loop may log many more).
CONSOLE_KEYS = (
    "reward/mean",
    "policy/clip_frac",
    "loss",
    "policy/loss",
    "grad_norm",
    "mismatch/abs_logp_diff",
    "perf/tokens_per_s",
    "time/step",
)


def global_rank() -> int:
    """This process's global rank: torch.distributed when initialised, else $RANK, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return int(os.environ.get("RANK", "0"))


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Python floats from numbers, 0-d tensors / numpy scalars; other values are dropped
    (a metric dict may carry strings or lists for other consumers)."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
            v = v.item()
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, int | float):
            out[str(k)] = float(v)
    return out


def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4g}"


class MetricsLogger:
    """Rank-0 metrics writer. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        log_dir: str | Path,
        *,
        jsonl: bool = True,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        progress: bool = True,
        total_steps: int | None = None,
        console_keys: Sequence[str] = CONSOLE_KEYS,
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
        log_every: int = 1,
        start_step: int = 0,
    ) -> None:
        self.enabled = (global_rank() if rank is None else rank) == 0
        self.log_dir = Path(log_dir)
        self.total_steps = total_steps
        self.console_keys = tuple(console_keys)
        self.log_every = max(1, log_every)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        self._progress = progress
        if not self.enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            # The resolved config next to the metrics, so a curve can be traced to its settings.
            (self.log_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
        if jsonl:
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.log_dir / "tb"))
            except ImportError as e:
                warnings.warn(
                    f"TensorBoard disabled ({e}); set logging.tensorboard=false", stacklevel=2
                )
        if wandb_project:
            try:
                import wandb
            except ImportError:
                warnings.warn(
                    f"logging.wandb_project={wandb_project!r} but wandb is not installed; W&B "
                    "logging skipped",
                    stacklevel=2,
                )
            else:
                self._wandb = wandb.init(
                    project=wandb_project, dir=str(self.log_dir), config=dict(config or {})
                )
        if progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,  # a resumed run continues the bar
                desc="gspo",
                unit="step",
                dynamic_ncols=True,
            )

    @classmethod
    def from_config(
        cls,
        logging_cfg: Any,
        *,
        total_steps: int | None = None,
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
        start_step: int = 0,
    ) -> MetricsLogger:
        """Build from a `megatron_gspo.config.LoggingConfig`."""
        return cls(
            logging_cfg.dir,
            jsonl=logging_cfg.jsonl,
            tensorboard=logging_cfg.tensorboard,
            wandb_project=logging_cfg.wandb_project,
            progress=logging_cfg.progress,
            total_steps=total_steps,
            config=config,
            rank=rank,
            log_every=logging_cfg.log_every,
            start_step=start_step,
        )

    @property
    def jsonl_path(self) -> Path:
        """Where the JSONL metrics go."""
        return self.log_dir / "metrics.jsonl"

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics (every `log_every` steps; the console line always moves)."""
        if not self.enabled:
            return
        scalars = to_scalars(metrics)
        if step % self.log_every == 0:
            if self._jsonl is not None:
                self._jsonl.write(json.dumps({"step": step, "time": time.time(), **scalars}) + "\n")
                self._jsonl.flush()
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.add_scalar(k, v, step)
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log(scalars, step=step)
        self._console(step, scalars)

    def console_line(self, step: int, scalars: Mapping[str, float]) -> str:
        """The short human summary of a step."""
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        parts += [f"{k} {_fmt(scalars[k])}" for k in self.console_keys if k in scalars]
        return " | ".join(parts)

    def _console(self, step: int, scalars: Mapping[str, float]) -> None:
        if not self._progress:
            return
        if self._bar is not None:
            shown = {k.split("/")[-1]: _fmt(scalars[k]) for k in self.console_keys if k in scalars}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(1)
        else:  # not a terminal (a log file): one plain line per step
            print(self.console_line(step, scalars), file=sys.stderr, flush=True)

    def close(self) -> None:
        """Flush and close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
