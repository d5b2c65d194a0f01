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

__all__ = [
    "DatasetError",
    "PromptDataset",
    "PromptLoader",
    "PromptRecord",
    "epoch_order",
    "load_prompt_jsonl",
    "render_prompt",
]
