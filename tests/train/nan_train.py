"""`megatron_gspo.train` with a planted fault: every policy loss is NaN (as if the model or the
data had diverged). Launched by tests/train/test_train_e2e.py through torchrun."""

from __future__ import annotations

from typing import Any

from megatron_gspo.megatron import step as mstep

_loss = mstep._policy_loss


def _nan_loss(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    loss, num_seqs, reduced = _loss(*args, **kwargs)
    nan = float("nan")
    return loss * nan, num_seqs, {**reduced, "loss": reduced["loss"] * nan}


if __name__ == "__main__":
    from megatron_gspo.train import cli

    mstep._policy_loss = _nan_loss
    cli()
