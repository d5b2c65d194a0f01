"""The prompt record and its reading from JSON objects: the leaf that `data/prompts.py` (the
dataset and loader) and `data/formats.py` (JSONL, Parquet, `datasets`) both build on, so that
neither imports the other back.

Each JSONL line is an object with a prompt string (`prompt_key`) or a chat message list
(`messages_key`), plus a ground-truth answer (`answer_key`); every other field is kept in
`PromptRecord.meta` for the reward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gspo.config_io import ConfigError

__all__ = ["DatasetError", "PromptRecord", "load_prompt_jsonl", "record_from_object"]


class DatasetError(ConfigError):
    """A malformed dataset file; the message names the file and line. A ConfigError, so the
    trainer reports it as bad input (one line, exit code 2) like a bad config key."""


@dataclass(kw_only=True, slots=True)
class PromptRecord:
    """One prompt of the dataset."""

    index: int
    """Position in the file (0-based, counting records, not blank lines)."""
    prompt: str | None = None
    """Plain prompt text (None when the record is a chat)."""
    messages: list[dict[str, str]] | None = None
    """Chat messages (None when the record is plain text)."""
    answer: Any = None
    """Ground truth handed to the reward function."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Every other field of the JSONL object."""

    def chat(self, system_prompt: str | None = None) -> list[dict[str, str]]:
        """The record as a message list (a plain prompt becomes one user message)."""
        msgs = list(self.messages) if self.messages is not None else []
        if self.messages is None:
            msgs = [{"role": "user", "content": self.prompt or ""}]
        if system_prompt is not None and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": system_prompt})
        return msgs


def _check_messages(msgs: object, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(msgs, list) or not msgs:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of messages")
    for i, m in enumerate(msgs):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: {key}[{i}] must be an object with string 'role' and 'content', "
                f"got {m!r:.80}"
            )
    return msgs


def record_from_object(
    obj: object,
    where: str,
    index: int,
    *,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    answer_key: str = "answer",
    require_answer: bool = True,
) -> PromptRecord:
    """One record from a decoded object (a JSONL line, a Parquet or `datasets` row); anything
    malformed raises `DatasetError` starting with `where` (file and line or row)."""
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    obj = dict(obj)  # popped below; the caller's row stays whole
    prompt, messages = obj.pop(prompt_key, None), obj.pop(messages_key, None)
    if prompt is None and messages is None:
        raise DatasetError(
            f"{where}: neither {prompt_key!r} nor {messages_key!r} is present "
            f"(keys: {sorted(obj)}); set data.prompt_key / data.messages_key"
        )
    if prompt is not None and not isinstance(prompt, str):
        raise DatasetError(f"{where}: {prompt_key!r} must be a string")
    if prompt is None:
        messages = _check_messages(messages, where, messages_key)
    else:
        messages = None  # a plain prompt wins when a record has both
    if answer_key not in obj and require_answer:
        raise DatasetError(
            f"{where}: no answer field {answer_key!r} (keys: {sorted(obj)}); set data.answer_key"
        )
    answer = obj.pop(answer_key, None)
    return PromptRecord(index=index, prompt=prompt, messages=messages, answer=answer, meta=obj)


def load_prompt_jsonl(
    path: str | Path,
    *,
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    answer_key: str = "answer",
    require_answer: bool = True,
) -> list[PromptRecord]:
    """Read a JSONL prompt file; blank lines are skipped, anything malformed raises
    `DatasetError` naming `file:line`."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such prompt file (data.train_path)")
    records: list[PromptRecord] = []
    # Bytes, decoded line by line: a decoding error then names its line (a text-mode file
    # would raise mid-iteration with neither file nor line).
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:  # utf-8-sig on the first line: editors on Windows write a byte-order mark
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            records.append(
                record_from_object(
                    obj,
                    where,
                    len(records),
                    prompt_key=prompt_key,
                    messages_key=messages_key,
                    answer_key=answer_key,
                    require_answer=require_answer,
                )
            )
    if not records:
        raise DatasetError(f"{path}: the file holds no prompts")
    return records
