"""The toy task: its tokenizer, dataset generator and partially-credited reward."""

from __future__ import annotations

import json
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_gspo.data.tiny_model import TINY_QWEN3_MOE
from megatron_gspo.data.toy import (
    TOY_VOCAB_SIZE,
    main,
    save_toy_tokenizer,
    toy_answer,
    write_toy_dataset,
)
from megatron_gspo.rewards.toy import toy_reward


def test_tokenizer_matches_the_tiny_model(toy_tokenizer):
    tok = toy_tokenizer
    assert len(tok) == TOY_VOCAB_SIZE <= TINY_QWEN3_MOE["vocab_size"]
    assert tok.pad_token_id == TINY_QWEN3_MOE["pad_token_id"] == 0
    assert tok.bos_token_id == TINY_QWEN3_MOE["bos_token_id"] == 1
    assert tok.eos_token_id == TINY_QWEN3_MOE["eos_token_id"] == 2


def test_tokenizer_is_character_level(toy_tokenizer):
    text = "rev 3812=2183 add 7+5=12, srt: x*y-z"
    ids = toy_tokenizer(text)["input_ids"]
    assert ids[0] == 1 and len(ids) == len(text) + 1  # <s> then one id per character
    assert toy_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert toy_tokenizer.decode(ids + [2], skip_special_tokens=False).endswith("</s>")
    # Every id a 128-vocab model can sample decodes to at most one character.
    for i in range(TOY_VOCAB_SIZE):
        assert len(toy_tokenizer.decode([i], skip_special_tokens=True)) == (i > 3)


def test_saved_tokenizer_loads_with_autotokenizer(tmp_path, toy_tokenizer):
    from transformers import AutoTokenizer

    from megatron_gspo.data.tiny_model import tiny_qwen3_moe_config

    # Next to the tiny model's config.json (model_type qwen3_moe), as the demo lays it out.
    tiny_qwen3_moe_config().save_pretrained(tmp_path / "tiny")
    save_toy_tokenizer(tmp_path / "tiny")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    text = "cpy 0912="
    assert loaded(text)["input_ids"] == toy_tokenizer(text)["input_ids"]
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.decode(loaded(text)["input_ids"], skip_special_tokens=True) == text


def _solve(prompt: str) -> str:
    """An independent solver of the prompt grammar."""
    op, rest = prompt.rstrip("=").split(" ")
    if op == "add":
        a, b = rest.split("+")
        return str(int(a) + int(b))
    return {"rev": rest[::-1], "cpy": rest, "srt": "".join(sorted(rest))}[op]


def test_generator_cli_is_deterministic_and_correct(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    main(["--out", str(a), "--n", "200", "--seed", "3", "--ops", "reverse,copy,sort,add"])
    write_toy_dataset(b, 200, seed=3, ops=("reverse", "copy", "sort", "add"))
    assert a.read_text() == b.read_text()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    assert len(rows) == 200 and {r["task"] for r in rows} == {"reverse", "copy", "sort", "add"}
    for r in rows:
        assert r["answer"] == _solve(r["prompt"])
    c = write_toy_dataset(tmp_path / "c.jsonl", 200, seed=4, ops=("reverse", "copy", "sort", "add"))
    assert c.read_text() != a.read_text()


def test_generator_lengths_and_errors(tmp_path):
    p = write_toy_dataset(tmp_path / "r.jsonl", 100, seed=0, min_len=3, max_len=5)
    for line in p.read_text().splitlines():
        digits = json.loads(line)["prompt"][4:-1]
        assert 3 <= len(digits) <= 5 and digits.isdigit()
    with pytest.raises(ValueError, match="unknown toy op 'mul'"):
        write_toy_dataset(tmp_path / "x.jsonl", 1, ops=("mul",))
    with pytest.raises(ValueError, match="min_len"):
        write_toy_dataset(tmp_path / "x.jsonl", 1, min_len=4, max_len=2)
    assert toy_answer("sort", "3120") == "0123"


def test_reward_exact_and_partial():
    assert toy_reward("rev 3812=", "2183", "2183") == 1.0
    assert toy_reward("rev 3812=", " 2183</s><pad>", "2183") == 1.0  # EOS text and spaces
    assert toy_reward("rev 3812=", "", "2183") == 0.0
    one_off = toy_reward("rev 3812=", "2184", "2183")
    two_off = toy_reward("rev 3812=", "2194", "2183")
    letters = toy_reward("rev 3812=", "abcd", "2183")
    too_long = toy_reward("rev 3812=", "21830000", "2183")
    assert 1.0 > one_off > two_off > letters > 0.0
    assert 0.0 < too_long < one_off
    assert one_off == pytest.approx(0.5 * 3 / 4 + 0.25 + 0.25)


@settings(max_examples=200, deadline=None)
@given(answer=st.text("0123456789", min_size=1, max_size=6), response=st.text(max_size=12))
def test_reward_is_in_unit_interval_and_one_only_when_exact(answer, response):
    r = toy_reward("", response, answer)
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == (response.split("</s>", 1)[0].strip() == answer)


def test_a_random_model_scores_low_with_variance_in_groups(toy_tokenizer):
    # A random policy over the 128 ids: uniform tokens, stopping at </s> or 8 new tokens.
    rng = random.Random(0)
    group_stds, means = [], []
    for _ in range(50):
        answer = "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 4)))
        rewards = []
        for _ in range(8):
            ids = []
            while len(ids) < 8 and (tok := rng.randrange(TOY_VOCAB_SIZE)) != 2:
                ids.append(tok)
            text = toy_tokenizer.decode(ids, skip_special_tokens=True)
            rewards.append(toy_reward("", text, answer))
        means.append(statistics.mean(rewards))
        group_stds.append(statistics.pstdev(rewards))
    assert 0.02 < statistics.mean(means) < 0.5
    assert sum(s > 0 for s in group_stds) >= 45  # nearly every group carries a signal
