"""The `data:` config section (`DataConfig`): which prompts, how they are read and rendered.
No torch; part of `megatron_gspo.config.Config`, read by `data/prompts.py` and the rollout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_gspo.config_io import at_least, positive, require

__all__ = ["DataConfig"]


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """The prompt dataset (JSONL, Parquet or Hugging Face `datasets`: a prompt string or chat
    messages, plus an answer)."""

    train_path: str
    """Training prompts: a JSONL file, or per data.format a Parquet file or a local dataset."""
    format: Literal["jsonl", "parquet", "hf", "auto"] = "jsonl"
    """How data.train_path (and eval.path) are read (`data/formats.py`): jsonl; parquet
    (pyarrow); hf (Hugging Face datasets, local only: a save_to_disk directory or a .json /
    .jsonl / .csv / .parquet / .arrow file); auto: by the path (directory: hf, .parquet:
    parquet, .csv / .arrow: hf, else jsonl). A row is read like a JSONL object."""
    prompt_key: str = "prompt"
    """Field holding the prompt text."""
    messages_key: str = "messages"
    """Field holding a chat message list (used when the prompt field is absent)."""
    answer_key: str = "answer"
    """Field holding the ground-truth answer passed to the reward."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template when it has one (else plain text)."""
    system_prompt: str | None = None
    """System message prepended to every chat (chat template only)."""
    seed: int = 0
    """Shuffling seed; the order of epoch e is a function of (seed, e) only."""
    shuffle: bool = True
    """Shuffle prompts every epoch (false: file order)."""
    max_prompt_tokens: int | None = None
    """Drop prompts longer than this many tokens at load time (rendered, as sent to the engine),
    printing how many; none left is an error. None: no limit."""

    def __post_init__(self) -> None:
        require(bool(self.train_path), "data.train_path is empty; set data.train_path")
        positive("data", max_prompt_tokens=self.max_prompt_tokens)
        at_least("data", 0, seed=self.seed)  # numpy's generators refuse a negative seed
