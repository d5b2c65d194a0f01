"""Planted faults for the fault tests: a rank kills, signals or breaks itself at a given point.

`MGSPO_FAULT` holds comma-separated `action@phase:step[:rank]` entries (rank 0 if omitted), e.g.
`MGSPO_FAULT=sigkill@backward:3:1` SIGKILLs rank 1 in the middle of step 3's first backward
pass. Unset (every real run), `point` returns at once. Points, in the order a step reaches them:

* `rollout`: right after rank 0 got the step's samples and rewards, before they are broadcast
  (the loader and the sample ids have advanced; the other ranks wait in the broadcast);
* `backward`: inside the step's first backward pass (a gradient hook on the first parameter);
* `update`: right after the step's optimizer updates, before the weights are checked, pushed
  or saved (`inf-weight` only: pass the model chunks);
* `checkpoint`: inside `save_checkpoint`, after the model and optimizer are written to the
  temporary directory and before the manifest, the rename and `latest`.

Actions: `sigkill` (this rank dies at once), `raise` (an exception), `hang` (the rank stops
making progress, as one stuck in a collective with a dead peer), `sigterm` (a SIGTERM to this
rank only), `sigterm-launcher` (a SIGTERM to the launcher, as a scheduler's preemption notice
reaches torchrun), `ctrl-c` (a SIGINT to the launcher, as a terminal's Ctrl-C reaches torchrun),
`ctrl-c-twice` (the same twice: the second once this rank has seen the first, forwarded),
`sighup-launcher` (a SIGHUP to the launcher, as a closed terminal or ssh session sends it),
`sigkill-launcher` (the launcher SIGKILLed: the ranks outlive it) and `inf-weight` (one
element of this rank's first parameter becomes inf, as an overflowing update makes it).
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["ENV", "PlantedFault", "point"]

ENV = "MGSPO_FAULT"
_ACTIONS = (
    "sigkill",
    "raise",
    "hang",
    "sigterm",
    "sigterm-launcher",
    "ctrl-c",
    "ctrl-c-twice",
    "sighup-launcher",
    "sigkill-launcher",
    "inf-weight",
)
_PHASES = ("rollout", "backward", "update", "checkpoint")


class PlantedFault(RuntimeError):
    """The exception of the `raise` action."""


def _planned(phase: str, step: int) -> list[str]:
    rank = int(os.environ.get("RANK", "0"))
    found = []
    for entry in filter(None, os.environ.get(ENV, "").split(",")):
        action, _, where = entry.partition("@")
        parts = where.split(":")
        if action not in _ACTIONS or parts[0] not in _PHASES or len(parts) not in (2, 3):
            raise ValueError(f"{ENV}: bad entry {entry!r} (action@phase:step[:rank])")
        at_rank = int(parts[2]) if len(parts) == 3 else 0
        if parts[0] == phase and int(parts[1]) == step and at_rank == rank:
            found.append(action)
    return found


def point(phase: str, step: int, model: list[Any] | None = None) -> None:
    """Fire the actions planned for `phase` of `step` (1-based) on this rank. For `backward`
    pass the model chunks: the actions then fire from inside the next backward pass."""
    actions = _planned(phase, step)
    if not actions:
        return
    if phase == "backward":
        if model is None:
            raise ValueError("point('backward', ...) needs the model")
        param = next(p for p in model[0].parameters() if p.requires_grad)
        handle: list[Any] = []

        def hook(grad: torch.Tensor) -> torch.Tensor:
            handle.pop().remove()  # the first backward of the step only
            _fire(actions, phase, step)
            return grad

        handle.append(param.register_hook(hook))
        return
    if "inf-weight" in actions:
        if model is None:
            raise ValueError("inf-weight needs the model")
        import torch

        with torch.no_grad():
            next(iter(model[0].parameters())).view(-1)[0] = float("inf")
        actions = [a for a in actions if a != "inf-weight"]
    _fire(actions, phase, step)


def _fire(actions: list[str], phase: str, step: int) -> None:
    for action in actions:
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never returns: the signal is delivered at once
        elif action == "raise":
            raise PlantedFault(f"planted fault at {phase} of step {step}")
        elif action == "hang":
            while True:
                time.sleep(1)
        elif action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif action == "sigterm-launcher":
            os.kill(os.getppid(), signal.SIGTERM)
        elif action == "sighup-launcher":
            os.kill(os.getppid(), signal.SIGHUP)
        elif action == "sigkill-launcher":
            os.kill(os.getppid(), signal.SIGKILL)
        else:  # ctrl-c, ctrl-c-twice
            os.kill(os.getppid(), signal.SIGINT)
            if action == "ctrl-c-twice":
                from megatron_gspo.run import stop

                deadline = time.monotonic() + 60
                while not stop.seen_sigint() and time.monotonic() < deadline:
                    time.sleep(0.05)
                os.kill(os.getppid(), signal.SIGINT)
                time.sleep(60)  # the forced exit comes while this rank waits here
