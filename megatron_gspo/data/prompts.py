"""Prompt datasets: JSONL records, chat-template rendering, and a resumable shuffled loader.

Each JSONL line is an object with a prompt string (`prompt_key`) or a chat message list
(`messages_key`: [{"role": ..., "content": ...}, ...]), plus a ground-truth answer
(`answer_key`); every other field is kept in `PromptRecord.meta` for the reward (the record
and its reading live in the leaf `data/records.py`, shared with `data/formats.py`).

The order of epoch `e` is a pure function of (seed, e, number of prompts), and the loader's
position is two integers, so a resumed run sees exactly the prompts an uninterrupted one would:

    loader = PromptLoader(dataset, prompts_per_rollout=32, seed=0)
    batch = loader.next_batch()          # list[PromptRecord]
    state = loader.state_dict()          # save with the checkpoint
    loader.load_state_dict(state)        # ... and continue from there
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from megatron_gspo.data.formats import load_prompt_records
from megatron_gspo.data.records import (
    DatasetError,
    PromptRecord,
    load_prompt_jsonl,
    record_from_object,
)
from megatron_gspo.engines.sglang_rules import engine_context_length  # the engines' rule

if TYPE_CHECKING:
    from megatron_gspo.data.config import DataConfig
    from megatron_gspo.data.tokenizer import Tokenizer

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


def render_prompt(
    record: PromptRecord,
    tokenizer: Tokenizer | None = None,
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
        tokenizer: Tokenizer | None = None,
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
        data_cfg: DataConfig,
        tokenizer: Tokenizer | None = None,
        context: tuple[int, int, str] | None = None,
        *,
        path: str | None = None,
        key: str | None = None,
        fit: tuple[int, str] | None = None,
    ) -> PromptDataset:
        """Build from a `megatron_gspo.config.DataConfig`: `data.train_path`, or `path` (named
        `key` in messages, e.g. the held-out set's `eval.path`) read the same way."""
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
