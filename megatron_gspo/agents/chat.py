"""Chat messages -> token ids with the model's chat template, without re-rendering what the model
already wrote.

Three renderings, all with `tokenizer.apply_chat_template` (the model's own template):

* `prompt_ids(messages)`: a whole conversation plus the generation prompt (a new trajectory,
  or one the agent changed beyond recognition);
* `after_model(new, last_model_ids)`: the text that follows a model turn the engine produced
  (ids recorded, never re-rendered): the rest of the template's closing of that turn (what the
  model did not emit itself, e.g. the newline after its `<|im_end|>`), the `new` messages, and
  the generation prompt. Found as the template's delta after a sentinel assistant message;
* `after_prompt(new)`: the text that follows a generation prompt, for a turn the agent replaced
  (edited or truncated): `new` starts with the agent's own assistant message, which becomes
  context (masked), then the rest and the generation prompt.

A template that re-renders earlier turns differently once more messages follow cannot give
deltas; that raises `ChatDeltaError` (the endpoint then renders the conversation whole, as a new
branch, and counts it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_gspo.data.tokenizer import Tokenizer

__all__ = ["ChatDeltaError", "ChatRenderer", "message_key", "template_message"]

_SENTINEL = "MGSPO7731"  # content no template rewrites
_HEAD = [{"role": "user", "content": "q"}]


class ChatDeltaError(ValueError):
    """The chat template cannot render a conversation as an append-only delta."""


def _text(content: str | list[object] | None) -> str:
    """OpenAI message content (None, a string, or a list of parts) as plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


def _canonical_args(arguments: object) -> str:
    """Tool-call arguments compared by value: `{"a":1}` and `{"a": 1}` are the same call."""
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two OpenAI messages the same turn: role, name, text, tool calls by name and
    argument value (ids, `refusal`, `annotations` and other echo fields are ignored)."""
    calls = tuple(
        (
            (tc.get("function") or {}).get("name"),
            _canonical_args((tc.get("function") or {}).get("arguments")),
        )
        for tc in message.get("tool_calls") or ()
    )
    return (message.get("role"), message.get("name"), _text(message.get("content")), calls)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as HF chat templates expect it: text content, tool-call arguments as
    objects (SGLang's server does the same before it renders)."""
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"))}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        calls = []
        for tc in message["tool_calls"]:
            fn = dict(tc.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    fn["arguments"] = json.loads(args)
                except ValueError:
                    pass
            calls.append({"id": tc.get("id"), "type": "function", "function": fn})
        out["tool_calls"] = calls
    return out


class ChatRenderer:
    """The model's chat template over OpenAI messages; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the agent endpoint needs a tokenizer with a chat template")
        self.tokenizer = tokenizer

    def _render(
        self,
        messages: Sequence[dict[str, Any]],
        gen: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=gen,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of template text (its special tokens map to their ids; no BOS added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(
        self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The whole conversation plus the generation prompt."""
        return self.encode(self._render(messages, True, tools))

    def after_model(
        self, new: Sequence[dict[str, Any]], last_model_ids: Sequence[int]
    ) -> list[int]:
        """Ids that follow a model turn ending in `last_model_ids`: its closing, `new`, and
        the generation prompt."""
        head = [*_HEAD, {"role": "assistant", "content": _SENTINEL}]
        base = self._render(head, False)
        full = self._render([*head, *new], True)
        end = base.find(_SENTINEL)
        if end < 0 or not full.startswith(base[: end + len(_SENTINEL)]):
            raise ChatDeltaError("the template re-renders a model turn once messages follow it")
        end += len(_SENTINEL)
        closing = base[end:]
        emitted = self.tokenizer.decode(list(last_model_ids[-1:]), skip_special_tokens=False)
        if emitted and closing.startswith(emitted):  # the model's own end-of-turn token
            end += len(emitted)
        return self.encode(full[end:])

    def after_prompt(self, new: Sequence[dict[str, Any]]) -> list[int]:
        """Ids that follow a generation prompt: `new` (from an assistant message the agent
        wrote) and the next generation prompt."""
        base = self._render(_HEAD, True)
        full = self._render([*_HEAD, *new], True)
        if not full.startswith(base):
            raise ChatDeltaError("the template renders the assistant turn apart from its prompt")
        return self.encode(full[len(base) :])
