"""Prompt datasets (JSONL, chat templates, resumable shuffling) and the built-in toy task."""

from megatron_gspo.data.prompts import (
    DatasetError,
    PromptDataset,
    PromptLoader,
    PromptRecord,
    epoch_order,
    load_prompt_jsonl,
    render_prompt,
)
from megatron_gspo.data.toy import build_toy_tokenizer, save_toy_tokenizer, write_toy_dataset

__all__ = [
    "DatasetError",
    "PromptDataset",
    "PromptLoader",
    "PromptRecord",
    "epoch_order",
    "load_prompt_jsonl",
    "build_toy_tokenizer",
    "render_prompt",
    "save_toy_tokenizer",
    "write_toy_dataset",
]
