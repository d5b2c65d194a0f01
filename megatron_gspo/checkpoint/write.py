"""A checkpoint that cannot be written (disk full, read-only, quota): one line, on every rank.

`save_checkpoint` runs its phases (create the temporary directory, write the shards and the
trainer state, write the manifest, rename) each inside `phase`, which catches the rank's own
error, and ends each with `agree`, a collective in place of the barrier that was there: every
rank learns whether any rank failed and raises the same `CheckpointWriteError`, so no rank is
left waiting in the next collective for one that died writing. The message names the
directory and the cause (`[Errno 28] No space left on device`), not a `CheckpointException`
traceback per rank.

Decision: a failed save, periodic or final, stops the job (exit code 5, after removing the
partial `step_N.tmp/`). The previous checkpoint is intact (`latest` still names it, the new
one never got its final name), so the run resumes from it once space is freed; training on
would risk hours of steps that no checkpoint holds.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["EXIT_CODE", "CheckpointWriteError", "WriteState", "describe"]

EXIT_CODE = 5


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (on some rank); raised on every rank alike."""


def describe(e: BaseException) -> str:
    """The root cause of a write failure in a few words: the first OSError in the chain
    (`[Errno 28] No space left on device: '<file>'`), else the first line of the message."""
    seen: set[int] = set()
    stack: list[BaseException] = [e]
    inner: BaseException | None = None  # the first error that is not a wrapper's
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if inner is None and not any(c.__name__ in _WRITE_ERRORS for c in type(cur).__mro__):
            inner = cur
        if isinstance(cur, OSError) and cur.errno is not None:
            where = f": {cur.filename}" if cur.filename else ""
            return f"[Errno {cur.errno}] {cur.strerror}{where}"
        failures = getattr(cur, "failures", None)  # torch.distributed.checkpoint's exception
        if isinstance(failures, dict):
            for f in failures.values():  # {rank: (exception, traceback)}
                inner = f[0] if isinstance(f, tuple) and f else getattr(f, "exc", f)
                if isinstance(inner, BaseException):
                    stack.append(inner)
        for nxt in (cur.__cause__, cur.__context__):
            if nxt is not None:
                stack.append(nxt)
    cause = inner or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {(text[0] if text else '')[:200]}"


# torch.distributed.checkpoint's CheckpointException derives from BaseException; megatron-core
# wraps errors in its CheckpointingException.
_WRITE_ERRORS = {"CheckpointException", "CheckpointingException"}


def _write_failure(e: BaseException) -> bool:
    """What writing a checkpoint can raise (not Ctrl-C, not a programming error)."""
    if isinstance(e, OSError | RuntimeError | ValueError):
        return True
    return any(c.__name__ in _WRITE_ERRORS for c in type(e).__mro__)


def _full_disk(root: Path, why: str) -> str:
    """`why`, prefixed with "No space left on device" when the file system of `root` has less
    free space than the last checkpoint takes (1 MiB when there is none): the cause of a
    failed write that torch's writers do not name."""
    if "[Errno" in why:
        return why
    try:
        free = shutil.disk_usage(root).free
        latest = root / "latest"
        last = root / latest.read_text().strip() if latest.is_file() else None
        need = sum(f.stat().st_size for f in last.rglob("*") if f.is_file()) if last else 1 << 20
    except OSError:
        return why
    if free >= max(need, 1 << 20):
        return why
    mib = f"{free / 2**20:.1f} MiB free, a checkpoint takes {need / 2**20:.1f} MiB"
    return f"No space left on device: {mib}; {why}"


class WriteState:
    """The outcome of one save on this rank: `phase` records a failure, `agree` shares it."""

    def __init__(self, root: Path, step: int, tmp: Path) -> None:
        self.root, self.step, self.tmp = root, step, tmp
        self.error: str | None = None

    @contextmanager
    def phase(self) -> Iterator[None]:
        """Run a part of the save; keep its error (`agree` follows every phase)."""
        try:
            yield
        except BaseException as e:
            if not _write_failure(e):
                raise
            self.error = describe(e)

    def agree(self) -> None:
        """Collective (replaces a barrier): every rank raises if any rank failed."""
        import torch

        from megatron_gspo import dist

        errors = [self.error]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            errors = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(errors, self.error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return
        # An errno names the cause best; torch's writers often report a full disk only as
        # "unexpected pos 704 vs 598" (the OSError is lost on the way between ranks).
        rank, why = next(((r, e) for r, e in failed if "[Errno" in e), failed[0])
        why = _full_disk(self.root, why)
        if dist.rank() == 0:  # free what the partial checkpoint took (a full disk)
            shutil.rmtree(self.tmp, ignore_errors=True)
        latest = self.root / "latest"
        kept = latest.read_text().strip() if latest.is_file() else None
        after = (
            f"{latest} still names {kept}, which is intact: resume from it with --resume once "
            "this is fixed"
            if kept
            else "no earlier checkpoint exists"
        )
        raise CheckpointWriteError(
            f"{self.root}: cannot write the checkpoint of step {self.step} (rank {rank}: {why}); "
            f"{after}"
        )
