"""Issue 26 (4): a prompt that cannot fit the engine's context with the response budget is
dropped and counted at load time, like one over data.max_prompt_tokens (was: it passed loading
and start-up, then step 1 died with `HTTP 400: The input (5242886 tokens) is longer than the
model's context length (512 tokens)`). The reference for what fits is SGLang's own rule: a
request is refused when prompt + max_new_tokens exceeds the context (tokenizer_manager)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_gspo.config_io import ConfigError
from megatron_gspo.data.prompts import PromptDataset, engine_context_length, load_prompt_jsonl
from megatron_gspo.data.tiny_model import TINY_QWEN3_MOE


def test_prompts_that_cannot_fit_the_engine_are_dropped_and_counted(
    tmp_path: Path, toy_tokenizer, capsys
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    context = engine_context_length(tmp_path)
    assert context == 64
    budget = 8
    path = tmp_path / "p.jsonl"
    sizes = (2, 55, 56, 5000, 3)  # 55 characters + BOS = 56 tokens: 56 + 8 = 64 fits exactly
    path.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "a"}) + "\n" for n in sizes))
    records = load_prompt_jsonl(path)
    unfiltered = PromptDataset(records, toy_tokenizer, chat_template=False)
    lengths = [len(unfiltered.encode(r)) for r in records]  # the ids the engine would get
    want = [n for n, t in zip(sizes, lengths) if t + budget <= context]  # SGLang's rule
    ds = PromptDataset(
        records, toy_tokenizer, chat_template=False, source=str(path),
        context=(context, budget, "rollout.max_new_tokens"),
    )  # fmt: skip
    assert [len(r.prompt or "") for r in ds] == want and 55 in want and 56 not in want
    assert ds.num_over_context == len(sizes) - len(want)
    err = capsys.readouterr().err
    assert (
        f"[data] {path}: dropped {len(sizes) - len(want)} of 5 prompts that do not fit the "
        f"engine's context of 64 tokens with rollout.max_new_tokens=8 response tokens"
    ) in err
    # both limits at once: each counted on its own line
    PromptDataset(
        records, toy_tokenizer, chat_template=False, max_prompt_tokens=10, source=str(path),
        context=(context, budget, "rollout.max_new_tokens"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="all 5 prompts are longer than the engine's context"):
        PromptDataset(records, toy_tokenizer, chat_template=False, context=(64, 63, "k"))


def test_the_engines_context_length() -> None:
    """`--context-length` in the launch flags wins; else SGLang's keys and rope factor."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        cfg = {**TINY_QWEN3_MOE, "max_position_embeddings": 512}
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        assert engine_context_length(d) == 512
        assert engine_context_length(d, ["--context-length", "300"]) == 300
        assert engine_context_length(d, ["--context-length=200"]) == 200
        cfg |= {"rope_scaling": {"factor": 4.0, "rope_type": "yarn"}}
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        assert engine_context_length(d) == 2048
        assert engine_context_length(Path(d) / "nothing") is None


def test_prompts_no_micro_batch_can_hold_are_dropped_or_refused(
    tmp_path: Path, toy_tokenizer
) -> None:
    """train.micro_batch_tokens=5 with 4 response tokens (issue 40: accepted, though no
    sequence fits; the budget was silently exceeded): what `make_rollout` passes as `fit`."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "a"}) + "\n" for n in (2, 9)))
    records = load_prompt_jsonl(path)
    lengths = [len(PromptDataset(records, toy_tokenizer, chat_template=False).encode(r))
               for r in records]  # fmt: skip
    fit = (lengths[0], "train.micro_batch_tokens=N with 4 response tokens")
    ds = PromptDataset(records, toy_tokenizer, chat_template=False, fit=fit, source=str(path))
    assert [len(r.prompt or "") for r in ds] == [2] and ds.num_over_micro_batch == 1
    with pytest.raises(ConfigError) as e:
        PromptDataset(records, toy_tokenizer, chat_template=False, fit=(1, "train.micro_batch_"
                      "tokens=5 with 4 response tokens"), source=str(path))  # fmt: skip
    msg = str(e.value)
    assert "all 2 prompts are longer than train.micro_batch_tokens=5" in msg, msg
    assert "raise train.micro_batch_tokens" in msg and "\n" not in msg
