"""A character-level chat tokenizer with a tool-calling chat template (built locally).

The toy tokenizer of `data/toy.py` has no chat template and no newline; agents written against
the OpenAI API need both. This one keeps its layout (ids 0-3 `<pad>`, `<s>`, eos, `<unk>`; eos is
`<|im_end|>`, id 2, the tiny model's `eos_token_id`), adds `<|im_start|>` and newline, and
carries a compact ChatML template in the Qwen2.5 tool-call format that SGLang's `qwen25`
tool-call parser reads:

    <|im_start|>assistant
    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call><|im_end|>

The template renders tool-call arguments with `tojson` (`{"a": 2, "b": 3}`), so a model that
wrote `{"a":2,"b":3}` is rendered back differently: the re-tokenisation drift the agent endpoint
must never train on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "build_chat_toy_tokenizer"]

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
_SPECIAL = ["<pad>", "<s>", IM_END, "<unk>", IM_START]
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
_SIZE = 128

_NL = "{{ '\\n' }}"
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system" + _NL + "{% if messages[0].role == 'system' %}"
    "{{ messages[0].content }}" + _NL + "{% endif %}tools:{% for t in tools %} "
    "{{ t.function.name if t.function is defined else t.name }}{% endfor %}<|im_end|>"
    + _NL
    + "{%- elif messages[0].role == 'system' %}<|im_start|>system"
    + _NL
    + "{{ messages[0].content }}<|im_end|>"
    + _NL
    + "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'user' or m.role == 'system' %}<|im_start|>{{ m.role }}"
    + _NL
    + "{{ m.content }}<|im_end|>"
    + _NL
    + "{%- elif m.role == 'assistant' %}<|im_start|>assistant"
    + _NL
    + "{%- if m.content %}{{ m.content }}{% endif %}"
    "{%- for tc in (m.tool_calls or []) %}{% set f = tc.function if tc.function is defined "
    "else tc %}{% if m.content or not loop.first %}"
    + _NL
    + "{% endif %}<tool_call>"
    + _NL
    + '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}'
    + _NL
    + "</tool_call>{%- endfor %}<|im_end|>"
    + _NL
    + "{%- elif m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|im_start|>user{% endif %}"
    + _NL
    + "<tool_response>"
    + _NL
    + "{{ m.content }}"
    + _NL
    + "</tool_response>{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>"
    + _NL
    + "{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + _NL + "{%- endif %}"
)


def _vocab() -> dict[str, int]:
    filler = [chr(0xC0 + i) for i in range(_SIZE - len(_SPECIAL) - len(_CHARS))]
    tokens = _SPECIAL + _CHARS + filler
    assert len(tokens) == _SIZE and len(set(tokens)) == _SIZE
    return {t: i for i, t in enumerate(tokens)}


def build_chat_toy_tokenizer() -> PreTrainedTokenizerFast:
    """A 128-id character `PreTrainedTokenizerFast` with `CHAT_TEMPLATE` (eos `<|im_end|>` = 2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token=IM_END,
        unk_token="<unk>",
        additional_special_tokens=[IM_START],
        model_max_length=512,
    )
    out.chat_template = CHAT_TEMPLATE
    return out
