"""Ctrl-C while a command is still starting (deep inside `import torch`) ends it with one line.

Python's default SIGINT handler raises `KeyboardInterrupt` wherever the main thread is, so a
Ctrl-C in the first seconds of a job printed a traceback from inside some library's import.
`quiet_ctrl_c()` is the first thing the entry points run (before any heavy import): until
something installs its own handler (the trainer's `StopSignals`, torchrun's agent), SIGINT
prints one line and end the process with the shell's code for SIGINT (130), leaving
nothing half-written behind (nothing has been written yet at that point; a tool that writes
has taken over by then or writes to a temporary name). Only standard-library imports here.

    from megatron_gspo.run.interrupt import quiet_ctrl_c
    quiet_ctrl_c("megatron_gspo.train")
"""

from __future__ import annotations

import os
import signal

__all__ = ["INTERRUPTED_EXIT_CODE", "quiet_ctrl_c"]

INTERRUPTED_EXIT_CODE = 130


def quiet_ctrl_c(what: str) -> None:
    """Main thread only. One line on stderr (rank 0 alone under torchrun) and exit 130."""

    def _exit(signum: int, _frame: object) -> None:
        if os.environ.get("RANK", "0") == "0":
            name = signal.Signals(signum).name
            os.write(2, f"[{what}] {name}: stopped while starting\n".encode())
        os._exit(INTERRUPTED_EXIT_CODE)

    signal.signal(signal.SIGINT, _exit)
