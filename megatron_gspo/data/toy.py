"""The built-in verifiable toy task and its character-level tokenizer (both built locally).

Task: a short digit string and an operation; the answer is another digit string.

    prompt "rev 3812="   answer "2183"      (reverse)
    prompt "cpy 3812="   answer "3812"      (copy)
    prompt "srt 3812="   answer "1238"      (sort)
    prompt "add 37+5="   answer "42"        (addition of two small numbers)

The reward (`megatron_gspo.rewards.toy.toy_reward`) gives partial credit, so that a random
tiny model already scores a little, with variance inside a group, and a perfect answer scores 1.

Tokenizer: one token per character. Ids 0-3 are `<pad>`, `<s>`, `</s>`, `<unk>` (pad/bos/eos as in
`megatron_gspo.data.tiny_model`), then the 95 printable ASCII characters, then filler characters up
to exactly 128 ids, so every id a 128-vocab model can sample decodes to one character.

    python -m megatron_gspo.data.toy --out data/toy_train.jsonl --n 2000 --seed 0
    python -m megatron_gspo.data.toy --tokenizer-dir /path/to/tiny_model   # save the tokenizer
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "TOY_OPS",
    "TOY_VOCAB_SIZE",
    "build_toy_tokenizer",
    "make_toy_example",
    "save_toy_tokenizer",
    "toy_answer",
    "write_toy_dataset",
]

TOY_VOCAB_SIZE = 128
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3
_PRINTABLE = [chr(c) for c in range(32, 127)]  # 95 characters, ids 4..98
# Latin-1 letters fill ids 99..127; they never occur in prompts or answers.
_FILLER = [chr(0xC0 + i) for i in range(TOY_VOCAB_SIZE - len(SPECIAL_TOKENS) - len(_PRINTABLE))]

TOY_OPS = {"reverse": "rev", "copy": "cpy", "sort": "srt", "add": "add"}


def _vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + _PRINTABLE + _FILLER
    assert len(tokens) == TOY_VOCAB_SIZE and len(set(tokens)) == TOY_VOCAB_SIZE
    return {t: i for i, t in enumerate(tokens)}


def build_toy_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level `PreTrainedTokenizerFast` (128 ids; pad=0, bos=1, eos=2).

    Encoding with `add_special_tokens=True` prepends `<s>`; decoding concatenates characters.
    It has no chat template: prompts are used as plain text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=_vocab(), unk_token="<unk>"))
    # Every character is its own word; "isolated" keeps spaces as tokens.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters without the WordLevel default spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
        padding_side="left",
    )


def save_toy_tokenizer(directory: str | Path) -> Path:
    """Write the toy tokenizer into `directory` (e.g. next to the tiny model's config.json) so
    that `AutoTokenizer.from_pretrained(directory)` loads it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_toy_tokenizer().save_pretrained(directory)
    return directory


def toy_answer(op: str, digits: str) -> str:
    """The ground truth of one task instance (`digits` is "a+b" for add)."""
    if op == "reverse":
        return digits[::-1]
    if op == "copy":
        return digits
    if op == "sort":
        return "".join(sorted(digits))
    if op == "add":
        a, b = digits.split("+")
        return str(int(a) + int(b))
    raise ValueError(f"unknown toy op {op!r}; choose from {sorted(TOY_OPS)}")


def make_toy_example(
    rng: random.Random, ops: tuple[str, ...] = ("reverse",), min_len: int = 2, max_len: int = 4
) -> dict[str, str]:
    """One JSONL record: {"prompt", "answer", "task"}; lengths count digits of the operand."""
    op = rng.choice(ops)
    if op == "add":
        # Operands of up to max_len - 1 digits keep the sum at most max_len digits long.
        hi = 10 ** max(1, max_len - 1) - 1
        digits = f"{rng.randint(0, hi)}+{rng.randint(0, hi)}"
    else:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_len, max_len)))
    return {"prompt": f"{TOY_OPS[op]} {digits}=", "answer": toy_answer(op, digits), "task": op}


def write_toy_dataset(
    path: str | Path,
    n: int,
    seed: int = 0,
    ops: tuple[str, ...] = ("reverse",),
    min_len: int = 2,
    max_len: int = 4,
) -> Path:
    """Write `n` toy records to a JSONL file; the same arguments give the same file."""
    for op in ops:
        if op not in TOY_OPS:
            raise ValueError(f"unknown toy op {op!r}; choose from {sorted(TOY_OPS)}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len})")
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(make_toy_example(rng, tuple(ops), min_len, max_len)) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Generate the toy task JSONL and/or save its tokenizer")
    p.add_argument("--out", help="JSONL file to write")
    p.add_argument("--n", type=int, default=1000, help="number of prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default="reverse", help=f"comma list of {','.join(TOY_OPS)}")
    p.add_argument("--min-len", type=int, default=2, help="fewest digits of an operand")
    p.add_argument("--max-len", type=int, default=4, help="most digits of an operand")
    p.add_argument("--tokenizer-dir", help="also save the character tokenizer into this directory")
    args = p.parse_args(argv)
    if not args.out and not args.tokenizer_dir:
        p.error("give --out and/or --tokenizer-dir")
    if args.out:
        ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
        write_toy_dataset(args.out, args.n, args.seed, ops, args.min_len, args.max_len)
        print(f"wrote {args.n} prompts to {args.out}")
    if args.tokenizer_dir:
        print(f"saved the toy tokenizer to {save_toy_tokenizer(args.tokenizer_dir)}")


if __name__ == "__main__":
    main()
