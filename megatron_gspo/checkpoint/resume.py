"""Preflight of a resume and of checkpoint writes, beyond the layout (`checkpoint/store.py`).

Run by `preflight` on every rank before anything starts (no megatron-core), each check ends
the job with one `ConfigError` line (exit code 2) naming the key or the files to change:

* `check_checkpoint_dir_writable`: `checkpoint.dir` (or its nearest existing parent) accepts a
  new file, so a read-only directory is refused now rather than at the first save, steps later.
* `check_resume_model`: `--resume` with another model than the checkpoint's (its `hf_config/`
  copy of the `config.json` it was trained from) is refused naming both models, instead of
  megatron-core's `Global shape mismatch` traceback after start-up.
* `resume_config_changes`: the config keys that differ from the checkpoint's `run_config.json`
  (written with every checkpoint). Keys whose saved state cannot follow a change
  (`FIXED_ON_RESUME`) are refused naming the key; the others (learning rate, schedule, weight
  decay, steps, sampling...) apply from the resumed step, and the trainer prints them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from megatron_gspo.checkpoint.files import HF_CONFIG_DIR, META_FILE, OPTIMIZER_FILE, RUN_CONFIG
from megatron_gspo.config_io import ConfigError, require

__all__ = [
    "FIXED_ON_RESUME",
    "check_checkpoint_dir_writable",
    "check_resume_model",
    "resume_config_changes",
    "saved_optimizer_classes",
]

# The optimizer state in the checkpoint belongs to these: Adam moments do not load into SGD,
# and the distributed optimizer's sharded state has another format than the plain one's.
FIXED_ON_RESUME = {
    "optim.optimizer": "its saved optimizer state is that optimizer's",
    "optim.use_distributed_optimizer": "its optimizer state is saved in that format",
    # The saved prompt loader (epoch, shuffled order, position) indexes the prompts of that
    # file as that run read, filtered and shuffled them (was: two tracebacks after start-up).
    "data.train_path": "its saved prompt-loader position indexes that file's prompts",
    "data.format": "its saved prompt-loader position indexes the prompts read that way",
    "data.seed": "its saved prompt order was shuffled with that seed",
    "data.shuffle": "its saved prompt order was made with that setting",
    "data.max_prompt_tokens": "its saved prompt-loader position indexes the prompts kept by it",
}

# config.json entries that define the model's parameters (names and shapes). A checkpoint of
# one model does not load into another that differs in any of these.
_ARCH_KEYS = (
    "model_type",
    "architectures",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "shared_expert_intermediate_size",
)


def check_checkpoint_dir_writable(directory: str | None) -> None:
    """A ConfigError unless a file can be created in `directory` (or, when it does not exist
    yet, in its nearest existing parent, where the trainer will create it)."""
    if directory is None:
        return
    path = Path(directory)
    probe_in = path
    while not probe_in.exists() and probe_in != probe_in.parent:
        probe_in = probe_in.parent
    require(
        probe_in.is_dir(),
        f"checkpoint.dir={directory}: {probe_in} is not a directory; change checkpoint.dir",
    )
    try:  # os.access misses read-only mounts and ACLs: create a file
        fd, name = tempfile.mkstemp(prefix=".mgspo_write_probe_", dir=probe_in)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        where = "" if probe_in == path else f" (its parent {probe_in}, which the run creates it in)"
        raise ConfigError(
            f"checkpoint.dir={directory}: cannot write there{where}: {e.strerror or e}; make it "
            "writable or change checkpoint.dir"
        ) from None


def _arch(config: dict[str, Any]) -> dict[str, Any]:
    return {k: config[k] for k in _ARCH_KEYS if k in config}


def check_resume_model(checkpoint: Path, hf_path: str) -> None:
    """A ConfigError naming both models when the checkpoint was trained from a model whose
    `config.json` differs from `model.hf_path`'s in any parameter-defining entry."""
    saved_file = checkpoint / HF_CONFIG_DIR / "config.json"
    try:
        saved = json.loads(saved_file.read_text(encoding="utf-8"))
        source = json.loads((checkpoint / META_FILE).read_text()).get("source", "?")
    except (OSError, ValueError, AttributeError):
        # missing or damaged: the checksum check that follows (`checkpoint.verify`) names it
        return
    now = json.loads((Path(hf_path) / "config.json").read_text(encoding="utf-8"))
    a, b = _arch(saved), _arch(now)
    diff = [f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in _ARCH_KEYS if a.get(k) != b.get(k)]
    require(
        not diff,
        f"{checkpoint}: trained from the model {source}, this run has model.hf_path={hf_path}, "
        f"another model ({'; '.join(diff[:4])}); resume with the checkpoint's model, or start a "
        "new run from a conversion of the checkpoint",
    )


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys that differ between launches of one run by design (the resume itself).
_IGNORED = ("checkpoint.resume",)


def resume_config_changes(checkpoint: Path, current: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every config key that differs from the checkpoint's run config
    (empty for checkpoints written before `RUN_CONFIG` existed). A ConfigError names the first
    changed key of `FIXED_ON_RESUME`."""
    try:
        saved = json.loads((checkpoint / RUN_CONFIG).read_text())
    except (OSError, ValueError):  # none (an older checkpoint), or damaged: `verify` names it
        return []
    # Through JSON, as it was saved: tuples compare equal to the lists they come back as.
    old, new = _flat(saved), _flat(json.loads(json.dumps(current, default=str)))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    changed = [k for k in changed if k not in _IGNORED]
    for key in changed:
        require(
            key not in FIXED_ON_RESUME,
            f"{key}={new.get(key)!r} on resume, the checkpoint {checkpoint} was written with "
            f"{old.get(key)!r} and {FIXED_ON_RESUME.get(key)}; set {key}={old.get(key)!r} to "
            "resume, or start a new run",
        )
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed]


def saved_optimizer_classes(checkpoint: Path) -> list[str] | None:
    """The inner optimizer classes whose state `checkpoint` holds (`OPTIMIZER_FILE`); None
    where it does not say (written before the file existed, no optimizer step taken yet, or
    damaged: `verify` names a damaged file)."""
    try:
        classes = json.loads((checkpoint / OPTIMIZER_FILE).read_text())["classes"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        return None
    return classes
