"""The metrics sink: a JSONL line per step, TensorBoard scalars, optional W&B, a progress bar
and a per-step text log.

Only global rank 0 writes; on other ranks every method is a no-op, so the loop can call it
unconditionally. (Named `metrics_log` so that it never shadows the standard `logging` module.)

    with MetricsLogger.from_config(cfg.logging, total_steps=cfg.train.steps) as m:
        m.log(step, {"reward/mean": 0.3, "policy/clip_frac": 0.01, ...})

JSONL format (`<dir>/metrics.jsonl`): `{"step": int, "time": unix seconds, <key>: value, ...}`,
one object per line, flushed each step, appended across resumes: a logger started at `start_step`
first removes the lines of later steps (logged again by the resumed run), so no step repeats
(a reader still keeps the last line of a repeated step). A value is a JSON number, or for a
non-finite value one of the STRINGS `"nan"`, `"inf"`, `"-inf"` (strict JSON has no NaN; `float()`
reads all three back). Non-finite values are never dropped: a diverged loss must show. "Not
measured" is an absent key.
`read_metrics` decodes the file (used by tools/plot_metrics.py and tools/reward_summary.py).

W&B (`logging.wandb_project`): a resumed run continues the same W&B run. The run id is kept in
`<dir>/wandb_run_id` (or given as `logging.wandb_run_id`); a logger started at `start_step` > 0
reuses it with `resume="allow"`, a fresh run (start_step 0 or None) gets a new id. Metrics are
logged against the trainer's step (`trainer/step`, W&B's step metric), not W&B's own counter,
which only grows: steps a resumed run logs again are then kept, not dropped by W&B.

Console (`logging.progress`): a tqdm bar on stderr over the steps, with ETA and a few metrics,
and the full line of any step with a non-finite metric; `progress=false`: nothing. Either way
every step's line goes to `<dir>/train.log`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import types
import uuid
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_gspo.config import LoggingConfig

__all__ = [
    "BAR_KEYS",
    "CONSOLE_KEYS",
    "MetricsLogger",
    "jsonl_value",
    "read_metrics",
    "to_scalars",
]

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
    "time/step_s",
)
# In the progress bar's postfix (short names): what says at a glance whether training is sane.
BAR_KEYS = {
    "reward/mean": "reward",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "policy/clip_frac": "clip",
}


def _rank() -> int:
    from megatron_gspo import dist  # lazily: the plotting tools import this module without torch

    return dist.rank()


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


_NONFINITE = ("nan", "inf", "-inf")


def jsonl_value(v: float) -> float | str:
    """A metric as written to metrics.jsonl: the number, or "nan" / "inf" / "-inf"."""
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def read_metrics(path: str | Path) -> dict[int, dict[str, float]]:
    """step -> {key: float} from a metrics.jsonl; a later line for the same step replaces the
    earlier one, non-finite strings become floats, and a cut last line is skipped."""
    rows: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                # The last line of a run killed mid-write may be cut; anything else is an error.
                print(f"{path}:{lineno}: skipping an unreadable line", file=sys.stderr)
                continue
            rows[int(row["step"])] = {
                k: float(v)
                for k, v in row.items()
                if isinstance(v, int | float) or v in _NONFINITE  # "nan" etc.; other text: no
            }
    return dict(sorted(rows.items()))


def _drop_steps_after(path: Path, step: int) -> None:
    """Remove the lines of steps after `step` (and a cut last line) from a metrics.jsonl.

    A run resumed from the checkpoint of step k logs steps k+1... again; the lines the
    interrupted run wrote for them (past its last checkpoint) would otherwise stay as duplicates.
    Rewritten to a temporary file and renamed, so a crash here never loses the kept lines."""
    if not path.exists():
        return
    kept: list[str] = []
    dropped = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                row_step = None  # a line cut by a kill mid-write
            if row_step is None or row_step > step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)


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
        start_step: int | None = None,
        wandb_run_id: str | None = None,
    ) -> None:
        """start_step: the step a resumed (or restarted) run continues from: lines of later steps
        are removed from metrics.jsonl and hidden in TensorBoard, since the run logs them again.
        None: append to whatever is there. wandb_run_id: the W&B run to log to (None: the one
        stored in the log directory when resuming, else a new one)."""
        self.enabled = (_rank() if rank is None else rank) == 0
        self.log_dir = Path(log_dir)
        self.total_steps = total_steps
        self.console_keys = tuple(console_keys)
        self.log_every = max(1, log_every)
        self._jsonl = None
        self._text = None
        self._tb = None
        self._wandb = None
        self._bar = None
        if not self.enabled:
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            # The resolved config next to the metrics, so a curve can be traced to its settings.
            # A resume with changed keys keeps the record: the previous config.json moves to
            # config.step_<N>.json (N: the step it was replaced at) before the new one is written.
            current = self.log_dir / "config.json"
            text = json.dumps(config, indent=2, default=str)
            if start_step and current.exists() and current.read_text() != text:
                current.replace(self.log_dir / f"config.step_{start_step:06d}.json")
            current.write_text(text)
        if jsonl and start_step is not None:
            _drop_steps_after(self.log_dir / "metrics.jsonl", start_step)
        if jsonl:
            self._jsonl = open(self.log_dir / "metrics.jsonl", "a", buffering=1)
        self._text = open(self.log_dir / "train.log", "a", buffering=1, encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides the earlier run's events from the resumed
                # step on (those steps are logged again).
                purge = None if start_step is None else start_step + 1
                self._tb = SummaryWriter(str(self.log_dir / "tb"), purge_step=purge)
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
                self._wandb = self._wandb_init(
                    wandb, wandb_project, wandb_run_id, config, resuming=bool(start_step)
                )
        if progress:
            from tqdm import tqdm

            tty = sys.stderr.isatty()
            self._bar = tqdm(
                total=total_steps,
                initial=start_step or 0,  # a resumed run continues the bar
                desc="gspo",
                unit="step",
                dynamic_ncols=tty,
                ncols=None if tty else 120,
                mininterval=0,  # steps take seconds: redraw on every one
                file=sys.stderr,
            )

    def _wandb_init(
        self,
        wandb: types.ModuleType,
        project: str,
        run_id: str | None,
        config: Mapping[str, Any] | None,
        *,
        resuming: bool,
    ) -> Any:
        """wandb.init on the run id of this run directory (see the module docstring)."""
        id_file = self.log_dir / "wandb_run_id"
        if run_id is None and resuming and id_file.is_file():
            run_id = id_file.read_text().strip() or None
        run_id = run_id or uuid.uuid4().hex[:12]  # W&B ids: letters and digits
        id_file.write_text(run_id + "\n")  # before init: a crash in it still leaves the id
        run = wandb.init(
            project=project,
            dir=str(self.log_dir),
            config=dict(config or {}),
            id=run_id,
            resume="allow",
        )
        run.define_metric("trainer/step")
        run.define_metric("*", step_metric="trainer/step")
        return run

    @classmethod
    def from_config(
        cls,
        logging_cfg: LoggingConfig,
        *,
        total_steps: int | None = None,
        config: Mapping[str, Any] | None = None,
        rank: int | None = None,
        start_step: int | None = None,
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
            wandb_run_id=getattr(logging_cfg, "wandb_run_id", None),
        )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one step's metrics (every `log_every` steps; the console line always moves)."""
        if not self.enabled:
            return
        scalars = to_scalars(metrics)
        if step % self.log_every == 0:
            if self._jsonl is not None:
                row: dict[str, float | str] = {"step": step, "time": time.time()}
                row |= {k: jsonl_value(v) for k, v in scalars.items()}
                self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
                self._jsonl.flush()
            if self._tb is not None:
                for k, v in scalars.items():
                    self._tb.add_scalar(k, v, step)
                self._tb.flush()
            if self._wandb is not None:
                self._wandb.log({**scalars, "trainer/step": step})
        self._console(step, scalars)

    def console_line(self, step: int, scalars: Mapping[str, float]) -> str:
        """The short human summary of a step: the console keys, then any other metric that is
        not finite (a diverging value must show even if it is not a console key)."""
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        parts += [f"{k} {_fmt(scalars[k])}" for k in self.console_keys if k in scalars]
        parts += [
            f"{k} {_fmt(v)}"
            for k, v in scalars.items()
            if not math.isfinite(v) and k not in self.console_keys
        ]
        return " | ".join(parts)

    def _console(self, step: int, scalars: Mapping[str, float]) -> None:
        line = self.console_line(step, scalars)
        if self._text is not None:
            self._text.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        if self._bar is not None:
            shown = {short: _fmt(scalars[k]) for k, short in BAR_KEYS.items() if k in scalars}
            self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            if any(not math.isfinite(v) for v in scalars.values()):
                self._bar.write(line, file=sys.stderr)  # above the bar, kept in the scrollback

    def close(self) -> None:
        """Flush and close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._text is not None:
            self._text.close()
            self._text = None
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
