"""Who may write a run's directories (`logging.dir`, `checkpoint.dir`): one run at a time, never
into a model or data directory, and a previous run replaced only once the new one has started.

    check_run_paths(cfg)                 # preflight: outputs vs inputs, a lock held elsewhere
    lock = RunLock.acquire(cfg)          # rank 0, after init_distributed; held until exit
    ...engines up, checkpoint loaded...
    clear_previous_run(cfg)              # --overwrite: rank 0, only now

The lock is `<dir>/.mgspo.lock` in each run directory, taken with `fcntl.flock` and holding
the owner's PID and host. The kernel drops a flock when its process dies (SIGKILL included),
so a lock file left by a dead run is stale by construction and simply taken over; on a file
system without flock (some network mounts) a lock whose PID no longer runs on this host is
taken over too. flock works across hosts on NFSv4 and Lustre; elsewhere it is per host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from megatron_gspo.checkpoint.store import has_checkpoint, remove_checkpoints
from megatron_gspo.config import Config
from megatron_gspo.config_io import ConfigError, require

__all__ = [
    "LOCK_NAME",
    "RunLock",
    "check_run_paths",
    "clear_previous_run",
    "previous_run_files",
]

LOCK_NAME = ".mgspo.lock"
# What a run writes into logging.dir / checkpoint.dir (the --overwrite set is a subset).
LOG_FILES = ("metrics.jsonl", "train.log", "config.json", "third_party.log", "tb", "engines")
CKPT_NAMES = ("latest", "step_*", "hf_final")


def _run_dirs(cfg: Config) -> list[Path]:
    dirs = [Path(cfg.logging.dir)]
    if cfg.checkpoint.dir is not None:
        dirs.append(Path(cfg.checkpoint.dir))
    unique: dict[Path, Path] = {}
    for d in dirs:
        unique.setdefault(d.resolve(), d)
    return list(unique.values())


def _inside(path: Path, root: Path) -> bool:
    """`path` is `root` or below it (both resolved: symlinks and `..` do not hide it)."""
    path, root = path.resolve(), root.resolve()
    return path == root or root in path.parents


def check_run_paths(cfg: Config) -> None:
    """Refuse outputs that would write into an input: logging.dir / checkpoint.dir equal to or
    inside model.hf_path or model.tokenizer_path, equal to the prompt file's directory, or an
    input that lies where the run writes (e.g. model.hf_path=<checkpoint.dir>/hf_final, which
    checkpoint.export_hf_at_end replaces). Then a lock held by a running run (`probe_lock`)."""
    inputs = [(Path(cfg.model.hf_path), "model.hf_path")]
    if cfg.model.tokenizer_path is not None:
        inputs.append((Path(cfg.model.tokenizer_path), "model.tokenizer_path"))
    outputs = [(Path(cfg.logging.dir), "logging.dir")]
    if cfg.checkpoint.dir is not None:
        outputs.append((Path(cfg.checkpoint.dir), "checkpoint.dir"))
    for out, out_key in outputs:
        for src, src_key in inputs:
            require(
                not _inside(out, src),
                f"{out_key}={out} is inside {src_key}={src}: the run would write its files "
                f"(config.json, checkpoints, logs) into the model's directory; set {out_key} "
                "to a directory of its own",
            )
        data_dir = Path(cfg.data.train_path).parent
        require(
            out.resolve() != data_dir.resolve(),
            f"{out_key}={out} is the directory of data.train_path={cfg.data.train_path}: the "
            f"run would write its files next to the data; set {out_key} to a directory of "
            "its own",
        )
    written = [(Path(cfg.logging.dir) / n, "logging.dir") for n in LOG_FILES]
    if cfg.checkpoint.dir is not None:
        ckpt = Path(cfg.checkpoint.dir)
        written += [(p, "checkpoint.dir") for n in CKPT_NAMES for p in _matches(ckpt, n)]
    data = Path(cfg.data.train_path)
    for src, src_key in [*inputs, (data, "data.train_path")]:
        for place, out_key in written:
            require(
                not _inside(src, place),
                f"{src_key}={src} lies in {place}, which the run writes ({out_key}); copy it "
                f"elsewhere or change {out_key}",
            )
    probe_lock(cfg)


def _matches(root: Path, pattern: str) -> list[Path]:
    if "*" not in pattern:
        return [root / pattern]
    return list(root.glob(pattern)) if root.is_dir() else []


def previous_run_files(cfg: Config) -> list[Path]:
    """What marks a previous run: a `metrics.jsonl` with at least one logged step, a
    checkpoint's `latest`. An empty metrics.jsonl (a start that failed before step 1) is not."""
    found = []
    metrics = Path(cfg.logging.dir) / "metrics.jsonl"
    with contextlib.suppress(OSError):
        with metrics.open("rb") as f:
            if any(line.strip() for line in f):
                found.append(metrics)
    if cfg.checkpoint.dir is not None and (marker := has_checkpoint(cfg.checkpoint.dir)):
        found.append(marker)
    return found


def clear_previous_run(cfg: Config) -> None:
    """--overwrite, rank 0, once the new run has started (engines up, model built): remove what
    it would otherwise append to or mix with. Only our own files: the directories may hold
    other things of the user's."""
    log_dir = Path(cfg.logging.dir)
    for name in ("metrics.jsonl", "train.log", "config.json"):
        (log_dir / name).unlink(missing_ok=True)
    shutil.rmtree(log_dir / "tb", ignore_errors=True)  # TensorBoard would show both runs
    if cfg.checkpoint.dir is not None:
        remove_checkpoints(cfg.checkpoint.dir)


def _holder(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _in_use(directory: Path, holder: dict[str, Any]) -> ConfigError:
    since = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if since else ""
    return ConfigError(
        f"{directory}: in use by the run of PID {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')}{when} ({directory / LOCK_NAME}); wait for it to end or "
        "stop it, or set logging.dir / checkpoint.dir to another directory"
    )


def _pid_alive_here(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot tell: assume it runs
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def _cannot_lock(cfg: Config, d: Path, e: OSError) -> ConfigError:
    """The one line for a run directory whose lock file cannot be written (was: a traceback
    from the lock, e.g. on a full disk)."""
    keys = [k for k, v in (("logging.dir", cfg.logging.dir), ("checkpoint.dir", cfg.checkpoint.dir))
            if v is not None and Path(v).resolve() == d.resolve()]
    why = e.strerror or type(e).__name__
    return ConfigError(
        f"{d}: cannot write the run's lock file {LOCK_NAME} ({why}); free space or fix the "
        f"mount, or change {' / '.join(keys) or 'logging.dir / checkpoint.dir'}"
    )


def probe_lock(cfg: Config) -> None:
    """Every rank, before anything is written: a ConfigError naming the PID and host of a run
    that holds a lock on one of the run directories. A shared probe: ranks of one job do not
    conflict with each other."""
    for d in _run_dirs(cfg):
        path = d / LOCK_NAME
        if not path.exists():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(d, _holder(path)) from None
        except OSError:  # no flock here: judge by the PID
            holder = _holder(path)
            if holder and _pid_alive_here(holder):
                raise _in_use(d, holder) from None
        finally:
            os.close(fd)


class RunLock:
    """Exclusive locks on a run's directories, held by this process until `release` or exit."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    @classmethod
    def acquire(cls, cfg: Config) -> RunLock:
        """Lock every run directory (created if needed) or raise the ConfigError of
        `probe_lock`; the lock files then name this process."""
        fds: list[int] = []
        try:
            for d in _run_dirs(cfg):
                path = d / LOCK_NAME
                try:
                    d.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                except OSError as e:  # a full disk, a read-only or vanished mount: bad input
                    raise _cannot_lock(cfg, d, e) from None
                fds.append(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise _in_use(d, _holder(path)) from None
                except OSError:
                    holder = _holder(path)
                    if holder and holder.get("pid") != os.getpid() and _pid_alive_here(holder):
                        raise _in_use(d, holder) from None
                me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
                except OSError as e:
                    raise _cannot_lock(cfg, d, e) from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(fds)

    def release(self) -> None:
        """Unlock (the files stay: removing them would race with a run taking them)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []
