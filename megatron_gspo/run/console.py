"""Keep the main job's console for our own output: third-party chatter goes to a log file.

megatron-core, megatron-bridge, transformers and torch log at import and model-build time
(megatron-bridge logs a full traceback for every optional import it misses, e.g.
`FP8GlobalStateManager` without Transformer Engine; deprecation notices; "No CUDA runtime").
None of it is actionable on a healthy run, and it buries the progress bar, but it is what one
reads when a run is not healthy, so it is kept, in `<logging.dir>/third_party.log`:

    route_third_party_output(cfg.logging.dir)        # every rank, as early as possible
    with third_party_stdio(cfg.logging.dir):         # around code that print()s (model build)
        policy = build(...)

Our own loggers (`megatron_gspo.*`) keep their console handlers. Records already printed
before the call (e.g. at import time) cannot be taken back: import heavy libraries after it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TextIO

__all__ = [
    "THIRD_PARTY_LOG",
    "hold_third_party_output",
    "release_held_output",
    "route_third_party_output",
    "routed_stdio",
    "survive_a_lost_console",
    "third_party_stdio",
]

THIRD_PARTY_LOG = "third_party.log"
_OURS = "megatron_gspo"
_FORMAT = "%(asctime)s {rank} %(levelname)s %(name)s: %(message)s"
_state: dict[Any, Any] = {}


def _rank() -> int:
    from megatron_gspo import dist

    return dist.rank()


def _is_console(handler: logging.Handler) -> bool:
    """Whether `handler` prints to the process's stdout / stderr."""
    if isinstance(handler, logging.FileHandler) or not isinstance(handler, logging.StreamHandler):
        return False
    consoles = {sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__}
    consoles |= {getattr(s, "_stream", None) for s in (sys.stdout, sys.stderr)}
    return any(handler.stream is s for s in consoles if s is not None)


def _is_ours(name: str) -> bool:
    return name == _OURS or name.startswith(_OURS + ".")


def _install_add_handler_hook(stream: IO[str] | None) -> None:
    # Libraries imported after the routing attach their own console handlers (transformers does
    # on import, megatron-bridge's import_utils too); those are pointed at the file instead.
    # Dropping them would not do: a logger with propagate=False and no handler falls back to
    # logging.lastResort, i.e. stderr.
    if "real_add_handler" not in _state:
        _state["real_add_handler"] = logging.Logger.addHandler

        def add_handler(self: logging.Logger, hdlr: logging.Handler) -> None:
            target = _state.get("stream")
            if (
                target is not None
                and isinstance(hdlr, logging.StreamHandler)
                and _is_console(hdlr)
                and not _is_ours(self.name)
            ):
                hdlr.setStream(target)
            _state["real_add_handler"](self, hdlr)

        logging.Logger.addHandler = add_handler  # type: ignore[method-assign]
    _state["stream"] = stream


def route_third_party_output(log_dir: str | Path, *, level: int = logging.INFO) -> Path:
    """Send every non-`megatron_gspo` logging record (`level` and above) and every Python
    warning to `<log_dir>/third_party.log` instead of the console; returns that path.

    Call on every rank (records carry the rank; ranks append to one file). Idempotent: a second
    call with another directory moves the routing there; what `hold_third_party_output` held
    in memory is written to the file first."""
    path = Path(log_dir) / THIRD_PARTY_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    old = _state.get("handler")
    if isinstance(old, logging.FileHandler) and Path(old.baseFilename) == path.resolve():
        return path
    held = _state.pop("held", None)
    if held is not None and held.getvalue():  # what was said before the file could exist
        with path.open("a", encoding="utf-8") as f:
            f.write(held.getvalue())
    _route(logging.FileHandler(path, mode="a", encoding="utf-8"), level)
    return path


def hold_third_party_output(*, level: int = logging.INFO) -> None:
    """Route as `route_third_party_output` does, into memory: for an entry point whose log
    file's directory may not be created yet (the conversion tools write theirs into the output
    directory, which exists only once the input, output and layout were accepted). A later
    `route_third_party_output` writes what was held to the file; `release_held_output` hands
    it back instead (a refusal drops it, a crash prints it)."""
    buffer = io.StringIO()
    _route(logging.StreamHandler(buffer), level)
    _state["held"] = buffer


def release_held_output() -> str:
    """What `hold_third_party_output` has held so far, emptied (routing stays in memory)."""
    held = _state.get("held")
    if held is None:
        return ""
    text = held.getvalue()
    held.seek(0)
    held.truncate()
    return text


def _route(handler: logging.StreamHandler, level: int) -> None:  # type: ignore[type-arg]
    old = _state.get("handler")
    old_stream = getattr(old, "stream", None)
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=f"rank{_rank()}")))
    root = logging.getLogger()
    for h in [h for h in root.handlers if _is_console(h)]:  # e.g. a library's basicConfig()
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    # Loggers that print by themselves (torch's, megatron-bridge's, ...): through the root.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or _is_ours(name):
            continue
        console = [h for h in logger.handlers if _is_console(h)]
        for h in console:
            logger.removeHandler(h)
        if console:
            logger.propagate = True
        for h in logger.handlers:  # pointed at the previous target by the addHandler hook
            if isinstance(h, logging.StreamHandler) and old_stream is not None:
                if h.stream is old_stream:
                    h.setStream(handler.stream)
    if old is not None:
        root.removeHandler(old)
        old.close()
    _state["handler"] = handler
    _install_add_handler_hook(handler.stream)  # FileHandler without delay: open already
    logging.captureWarnings(True)  # warnings.warn -> logger "py.warnings" -> the file
    _keep_ours_on_console()


@contextlib.contextmanager
def routed_stdio() -> Iterator[None]:
    """`print()` to stdout / stderr within the block goes where third-party logging is routed
    (the held buffer or `third_party.log`); without routing, nothing changes (a library
    function called from a test or a notebook keeps its output)."""
    handler = _state.get("handler")
    if handler is None:
        yield
        return
    target = handler.stream if "held" in _state else _stdio_file(Path(handler.baseFilename))
    with contextlib.redirect_stdout(target), contextlib.redirect_stderr(target):
        yield
    target.flush()


def _keep_ours_on_console() -> None:
    # Our warnings (e.g. a retried rollout request) reached the console through the root's
    # last-resort handler; the root now writes to the file, so ours get a handler of their own.
    ours = logging.getLogger(_OURS)
    if "ours" not in _state:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("[%(name)s] %(levelname)s: %(message)s"))
        _state["real_add_handler"](ours, handler)
        _state["ours"] = handler
    ours.propagate = True  # and into the file too, next to the library records around them


def _restore() -> None:
    """Undo `route_third_party_output` (tests): console handlers removed then stay removed."""
    _state.pop("held", None)
    handler = _state.pop("handler", None)
    if handler is not None:
        logging.getLogger().removeHandler(handler)
        handler.close()
    ours = _state.pop("ours", None)
    if ours is not None:
        logging.getLogger(_OURS).removeHandler(ours)
    if "real_add_handler" in _state:
        logging.Logger.addHandler = _state.pop("real_add_handler")  # type: ignore[method-assign]
    _state.pop("stream", None)
    logging.captureWarnings(False)


@contextlib.contextmanager
def third_party_stdio(log_dir: str | Path) -> Iterator[Path]:
    """Within the block, `print()` to stdout/stderr (and rich/tqdm bars created inside it) go to
    `<log_dir>/third_party.log`: megatron prints parameter counts, the bridge draws a loading
    bar. Python-level only: what C++ code writes to the file descriptors is not caught."""
    path = Path(log_dir) / THIRD_PARTY_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    f = _stdio_file(path)
    try:
        with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
            yield path
    finally:
        f.flush()


def _stdio_file(path: Path) -> IO[str]:
    """One append stream per third_party.log, open for the life of the process: a library
    that keeps `sys.stderr` as it was inside the block (a logging handler made there, a
    progress bar) writes to the file later too. Closing it at the end of each block made
    those writes fail (`--- Logging error --- ... I/O operation on closed file`, issue 40)."""
    key = str(path.resolve())
    f = _state.get(("stdio", key))
    if f is None or f.closed:
        f = _state[("stdio", key)] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    return f


class _ConsoleStream:
    """A console stream whose writes stop, silently, once the console is gone: a closed
    terminal (EIO) or a reader that went away (`| head`: EPIPE). Everything else is the
    stream's own."""

    _GONE = (errno.EIO, errno.EPIPE, errno.ENXIO)

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = False

    def _guard[R](self, fn: Callable[..., R], *args: object) -> R | None:
        if self.lost:
            return None
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in self._GONE:
                raise
            self.lost = True
            return None

    def write(self, text: str) -> int:
        self._guard(self._stream.write, text)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        self._guard(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_a_lost_console() -> None:
    """Keep this process running when its console goes away (the terminal or ssh session
    closed, the reader of a pipe gone): writes to stdout / stderr then do nothing instead of
    raising in the middle of a step, so the run reaches its checkpoint (the SIGHUP that
    follows is a graceful stop: `stop.py`). Idempotent."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ConsoleStream):
            setattr(sys, name, _ConsoleStream(stream))
