"""The stop rules of megatron_gspo/run/stop.py, signal by signal (in-process; the forced exit is
recorded instead of taken). The end-to-end behaviour is tests/train/test_faults_e2e.py."""

from __future__ import annotations

import signal

import pytest

from megatron_gspo.run.stop import StopSignals

TERM, INT = signal.SIGTERM, signal.SIGINT


@pytest.mark.parametrize(
    "signals, forced_at",
    [
        ([TERM], None),  # graceful: checkpoint at the step boundary
        ([INT], None),  # the first Ctrl-C too
        ([TERM, TERM], None),  # a scheduler and torchrun may both deliver one: still graceful
        ([TERM, INT], None),  # a first Ctrl-C after a preemption notice: still graceful
        ([TERM, INT, INT], 2),  # ... a second one forces
        ([INT, INT], 1),  # Ctrl-C twice on a rank
        ([INT, TERM], 1),  # torchrun's answer to a second Ctrl-C on it
    ],
)
def test_which_signal_forces_the_exit(signals, forced_at, monkeypatch) -> None:
    stop = StopSignals(grace_s=600)
    forced: list[int] = []
    for i, sig in enumerate(signals):
        monkeypatch.setattr(stop, "force", lambda why, at=i: forced.append(at))
        stop.on_signal(sig)
    assert stop.requested == signal.Signals(signals[0]).name
    assert forced == ([] if forced_at is None else [forced_at])
    assert stop.agreed()  # one rank: its own request
    assert not StopSignals(grace_s=600).agreed()
