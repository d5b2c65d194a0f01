"""Tool calls in a model's text, parsed by SGLang's own `FunctionCallParser` (the parser its
OpenAI server uses for `--tool-call-parser NAME`), so the agent endpoint answers tool calls
exactly as an SGLang server with that flag would.

SGLang loads lazily (several seconds), on the first response that may hold a tool call.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

__all__ = ["ParsedToolCall", "parse_tool_calls", "tool_call_parser_names"]


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call as OpenAI's `tool_calls[i].function`: a name and its arguments as JSON text."""

    name: str
    arguments: str


@functools.cache
def tool_call_parser_names() -> tuple[str, ...]:
    """The `--tool-call-parser` values SGLang knows."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    return tuple(sorted(FunctionCallParser.ToolCallParserEnum))


def parse_tool_calls(
    text: str, tools: Sequence[dict[str, Any]], parser: str
) -> tuple[str, list[ParsedToolCall]]:
    """(normal text, calls) of a complete response `text`, as SGLang's non-streaming chat
    completion parses it: no `tools`, or text without the parser's markers, gives (text, [])."""
    if not tools:
        return text, []
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    fcp = FunctionCallParser([Tool.model_validate(t) for t in tools], parser)
    if not fcp.has_tool_call(text):
        return text, []
    normal, items = fcp.parse_non_stream(text)
    calls = [ParsedToolCall(name=str(it.name or ""), arguments=it.parameters) for it in items]
    return normal, calls
