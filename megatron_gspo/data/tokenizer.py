"""What the package calls on a tokenizer: the smallest protocol its consumers share.

A run's tokenizer is a Hugging Face one (`AutoTokenizer.from_pretrained`, the toy
`PreTrainedTokenizerFast`s of `data/toy.py` and `data/chat_toy.py`); tests pass small fakes.
Hugging Face annotates `decode` and `apply_chat_template` with the union of everything they can
return (a batch of strings, token ids); the calls made here (one sequence, `tokenize=False`)
return text, so a loaded tokenizer is `cast` to this protocol where it is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Tokenizer"]


class Tokenizer(Protocol):
    """Encode one text, decode one sequence, render a chat with the model's template."""

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id (a stop token for generation), None when it has none."""
        ...

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Mapping[str, Any]:
        """The encoding of `text`; its `input_ids` are the token ids."""
        ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str:
        """The text of one sequence of ids."""
        ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = ...,
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
    ) -> str:
        """The conversation rendered by the model's chat template (with `tokenize=False`)."""
        ...
