"""Prompt datasets: JSONL records, chat-template rendering, and a resumable shuffled loader.

Each JSONL line is an object with a prompt string (`prompt_key`) or a chat message list
(`messages_key`: [{"role": ..., "content": ...}, ...]), plus a ground-truth answer
(`answer_key`); every other field is kept in `PromptRecord.meta` for the reward.

The order of epoch `e` is a pure function of (seed, e, number of prompts), and the loader's
position is two integers, so a resumed run sees exactly the prompts an uninterrupted one would:

    loader = PromptLoader(dataset, prompts_per_rollout=32, seed=0)
    batch = loader.next_batch()          # list[PromptRecord]
    state = loader.state_dict()          # save with the checkpoint
    loader.load_state_dict(state)        # ... and continue from there
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gspo.config_io import ConfigError
from megatron_gspo.engines.sglang_rules import engine_context_length  # the engines' rule

__all__ = [
    "DatasetError",
    "PromptDataset",
    "PromptLoader",
    "PromptRecord",
    "engine_context_length",
    "epoch_order",
    "load_prompt_jsonl",
    "record_from_object",
    "render_prompt",
]


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


def _check_messages(msgs: Any, where: str, key: str) -> list[dict[str, str]]:
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
    obj: Any,
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


def render_prompt(
    record: PromptRecord,
    tokenizer: Any = None,
    *,
    chat_template: bool = True,
    system_prompt: str | None = None,
) -> str:
    """The text sent to the engine.

    With `chat_template` and a tokenizer that has one: `apply_chat_template` with the
    generation prompt. Otherwise plain text: the prompt itself, or for a chat the messages as
    "role: content" lines followed by "assistant: ".
    """
    if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            record.chat(system_prompt), tokenize=False, add_generation_prompt=True
        )
    if record.messages is None:
        return record.prompt or ""
    lines = [f"{m['role']}: {m['content']}" for m in record.chat(system_prompt)]
    return "\n".join(lines) + "\nassistant: "


class PromptDataset(Sequence[PromptRecord]):
    """Records plus the rendering / tokenisation policy of the run."""

    def __init__(
        self,
        records: list[PromptRecord],
        tokenizer: Any = None,
        *,
        chat_template: bool = True,
        system_prompt: str | None = None,
        max_prompt_tokens: int | None = None,
        context: tuple[int, int, str] | None = None,
        fit: tuple[int, str] | None = None,
        source: str = "the prompt dataset",
    ) -> None:
        """context: (the engine's context length, the response budget, the budget's key):
        prompts longer than their difference cannot be served (SGLang refuses a request whose
        prompt plus max_new_tokens exceeds its context) and are dropped here, counted.
        fit: (the most prompt tokens a training micro-batch can hold with a whole response,
        what sets it): longer prompts would make sequences no micro-batch holds
        (`train.micro_batch_tokens` silently ignored); dropped here, counted, all: refused."""
        self.records = records
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt
        self.max_prompt_tokens = max_prompt_tokens
        self.num_too_long = 0  # prompts dropped for being longer than max_prompt_tokens
        self.num_over_context = 0  # ... for not fitting the engine's context with the budget
        self.num_over_micro_batch = 0  # ... for making a sequence no micro-batch holds
        limits = []
        if max_prompt_tokens is not None:
            limits.append((max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"))
        if context is not None:
            context_len, budget, budget_key = context
            limits.append(
                (
                    context_len - budget,
                    f"the engine's context of {context_len} tokens with {budget_key}={budget} "
                    "response tokens",
                )
            )
        if fit is not None:
            limits.append(fit)
        if limits:
            if tokenizer is None:
                raise ValueError("max_prompt_tokens / context need a tokenizer")
            # Filtered here, once, rather than at the step that samples one: an over-long prompt
            # would otherwise fail (or be truncated by) the engine mid-run.
            lengths = [len(self.encode(r)) for r in records]
            for limit, what in limits:
                records, lengths = self._drop_longer(records, lengths, limit, what, source)
                if what.startswith("data."):
                    self.num_too_long = self._dropped
                elif what.startswith("train."):
                    self.num_over_micro_batch = self._dropped
                else:
                    self.num_over_context = self._dropped
            self.records = records

    def _drop_longer(
        self, records: list[PromptRecord], lengths: list[int], limit: int, what: str, source: str
    ) -> tuple[list[PromptRecord], list[int]]:
        """Keep the records of at most `limit` tokens; one stderr line counting the others."""
        kept = [(r, n) for r, n in zip(records, lengths) if n <= limit]
        self._dropped = len(records) - len(kept)
        if not kept:
            fix = "raise data.max_prompt_tokens"
            if what.startswith("train."):
                fix = f"at most {limit} prompt tokens fit: raise train.micro_batch_tokens or "
                fix += "lower rollout.max_new_tokens"
            elif not what.startswith("data."):
                fix = f"at most {limit} prompt tokens fit: lower rollout.max_new_tokens or raise "
                fix += "the engine's context length"
            raise DatasetError(
                f"{source}: all {len(records)} prompts are longer than {what} (shortest: "
                f"{min(lengths)} tokens); {fix}"
            )
        if self._dropped:
            longest = max(lengths)
            what_line = (
                f"longer than {what} tokens"
                if what.startswith("data.")
                else f"that do not fit {what} (over {limit} prompt tokens)"
            )
            print(
                f"[data] {source}: dropped {self._dropped} of {len(records)} prompts "
                f"{what_line} (longest: {longest}); {len(kept)} remain",
                file=sys.stderr,
                flush=True,
            )
        return [r for r, _ in kept], [n for _, n in kept]

    @classmethod
    def from_config(
        cls,
        data_cfg: Any,
        tokenizer: Any = None,
        context: tuple[int, int, str] | None = None,
        *,
        path: str | None = None,
        key: str | None = None,
        fit: tuple[int, str] | None = None,
    ) -> PromptDataset:
        """Build from a `megatron_gspo.config.DataConfig`: `data.train_path`, or `path` (named
        `key` in messages, e.g. the held-out set's `eval.path`) read the same way."""
        from megatron_gspo.data.formats import load_prompt_records

        source = path if path is not None else data_cfg.train_path
        records = load_prompt_records(
            source,
            fmt=getattr(data_cfg, "format", "jsonl"),
            prompt_key=data_cfg.prompt_key,
            messages_key=data_cfg.messages_key,
            answer_key=data_cfg.answer_key,
            key=key or "data.train_path",
        )
        return cls(
            records,
            tokenizer,
            chat_template=data_cfg.chat_template,
            system_prompt=data_cfg.system_prompt,
            max_prompt_tokens=data_cfg.max_prompt_tokens,
            context=context,
            fit=fit,
            source=str(source),
        )

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:  # type: ignore[override]
        return self.records[i]

    def render(self, record: PromptRecord) -> str:
        """Prompt text for the engine (see `render_prompt`)."""
        return render_prompt(
            record,
            self.tokenizer,
            chat_template=self.chat_template,
            system_prompt=self.system_prompt,
        )

    def encode(self, record: PromptRecord) -> list[int]:
        """Prompt token ids. A chat-templated text carries its own special tokens, so only plain
        text gets the tokenizer's (e.g. BOS)."""
        if self.tokenizer is None:
            raise ValueError("PromptDataset.encode needs a tokenizer")
        templated = self.chat_template and getattr(self.tokenizer, "chat_template", None)
        ids = self.tokenizer(self.render(record), add_special_tokens=not templated)["input_ids"]
        return list(ids)


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The permutation used for one epoch: a function of (num_items, seed, epoch) only.

    `random.Random` seeded by a string is stable across Python processes and versions
    (it hashes with SHA-512, not the salted `hash()`).
    """
    order = list(range(num_items))
    if shuffle:
        random.Random(f"megatron-gspo:{seed}:{epoch}").shuffle(order)
    return order


class PromptLoader:
    """Endless batches of P prompts, reshuffled each epoch; a batch may span an epoch boundary
    (nothing is dropped). The position is (epoch, offset into that epoch's order)."""

    def __init__(
        self,
        dataset: Sequence[PromptRecord],
        prompts_per_rollout: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if prompts_per_rollout < 1:
            raise ValueError(f"prompts_per_rollout={prompts_per_rollout} must be >= 1")
        if len(dataset) == 0:
            raise ValueError("the prompt dataset is empty")
        self.dataset = dataset
        self.prompts_per_rollout = prompts_per_rollout
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = epoch_order(len(dataset), seed, 0, shuffle)

    def next_indices(self) -> list[int]:
        """Dataset indices of the next batch; advances the position."""
        out: list[int] = []
        while len(out) < self.prompts_per_rollout:
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
            take = min(self.prompts_per_rollout - len(out), len(self._order) - self.offset)
            out.extend(self._order[self.offset : self.offset + take])
            self.offset += take
        return out

    def next_batch(self) -> list[PromptRecord]:
        """The next P records."""
        return [self.dataset[i] for i in self.next_indices()]

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """The position, plus what it is only valid for (checked on load)."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a different dataset size, seed or shuffle,
        since the saved offset would then point into a different order."""
        for key, mine in (
            ("num_prompts", len(self.dataset)),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if state[key] != mine:
                raise ValueError(
                    f"cannot resume the prompt loader: checkpoint has {key}={state[key]}, this "
                    f"run has {mine} (data.train_path / data.seed / data.shuffle changed?)"
                )
        if not 0 <= state["offset"] <= state["num_prompts"] or state["epoch"] < 0:
            raise ValueError(f"corrupt prompt loader state {state}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
