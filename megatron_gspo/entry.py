"""Console scripts of the wheel (setup.py `entry_points`). Standard library only at import:
each installs the one-line Ctrl-C handler (`interrupt.py`) before importing torch.

    megatron-gspo-train --config my.yaml          # = python -m megatron_gspo.train
    megatron-gspo-convert-to-hf -i ckpt -o hf    # = tools/convert_megatron_to_hf.py
    megatron-gspo-convert-from-hf -i hf -o ckpt  # = tools/convert_hf_to_megatron.py
"""

from __future__ import annotations

from megatron_gspo.run.interrupt import quiet_ctrl_c

__all__ = ["convert_from_hf", "convert_to_hf", "train"]


def train() -> None:
    quiet_ctrl_c("megatron-gspo-train")
    from megatron_gspo.train import cli

    cli()


def _convert(direction: str, name: str) -> int:
    quiet_ctrl_c(name)
    from megatron_gspo.weights.convert import cli

    return cli(direction)


def convert_to_hf() -> int:
    """A training or conversion checkpoint (any layout) -> a Hugging Face model directory."""
    return _convert("megatron_to_hf", "megatron-gspo-convert-to-hf")


def convert_from_hf() -> int:
    """A Hugging Face model directory -> a megatron-core checkpoint at a layout."""
    return _convert("hf_to_megatron", "megatron-gspo-convert-from-hf")
