"""The names of the files in a checkpoint directory: the leaf every writer and reader of a
checkpoint imports, so that none of them imports another for a name.

Written by the trainer's save (`checkpoint/store.py`, through the adapter
`megatron/checkpoint.py`) and by the conversion tools (`weights/convert.py`); read by resume,
verify and preflight (`checkpoint/resume.py`, no torch). Imports nothing of the package: before
it, the save (`checkpoint/store.py`), the adapter (`megatron/checkpoint.py`), the resume checks
(`checkpoint/resume.py`) and the conversion (`weights/convert.py`) imported each other in a
circle for these names.
"""

from __future__ import annotations

__all__ = ["FRESH_OPTIMIZER", "HF_CONFIG_DIR", "META_FILE", "OPTIMIZER_FILE", "RUN_CONFIG"]

HF_CONFIG_DIR = "hf_config"
"""The model's `config.json`, tokenizer and generation files, copied from `model.hf_path`: all
`convert_megatron_to_hf` needs besides the weights (`weights.convert.write_source_info`)."""

META_FILE = "mgspo_conversion.json"
"""Where the checkpoint came from: the source model, the parallel layout and world size it was
written at, the parameter and HF dtypes (`weights.convert.write_source_info`)."""

RUN_CONFIG = "run_config.json"
"""The resolved config of the run that wrote a checkpoint (`Config.to_dict()`), in its step
directory; a resume compares it (`checkpoint.resume.resume_config_changes`)."""

FRESH_OPTIMIZER = "optimizer_fresh"
"""Marks a checkpoint written before any optimizer step: the model alone is its state (no
optimizer state, no `adam_steps_rank*.pt`); `megatron/checkpoint.py` writes and reads it."""

OPTIMIZER_FILE = "optimizer.json"
"""`{"classes": [...]}`: the inner optimizer classes whose state the checkpoint holds (one per
chained optimizer, `patches.optimizer.optimizer_classes`); a resume compares them with the
optimizer it will build before any model is built (`run/preflight.check_optimizer`). Absent
from checkpoints written before it and from `FRESH_OPTIMIZER` ones (no optimizer state)."""
