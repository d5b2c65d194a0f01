"""Prompt datasets: JSONL parsing and errors, rendering, deterministic order, exact resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.data import (
    DatasetError,
    PromptDataset,
    PromptLoader,
    PromptRecord,
    epoch_order,
    load_prompt_jsonl,
    render_prompt,
)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_load_prompt_and_messages(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "1+1=", "answer": "2", "source": "toy"},
            "",  # blank lines are skipped and do not shift record indices
            {"messages": [{"role": "user", "content": "hi"}], "answer": 3},
        ],
    )
    recs = load_prompt_jsonl(p)
    assert [r.index for r in recs] == [0, 1]
    assert recs[0].prompt == "1+1=" and recs[0].answer == "2" and recs[0].meta == {"source": "toy"}
    assert recs[1].messages == [{"role": "user", "content": "hi"}] and recs[1].answer == 3
    assert recs[1].prompt is None


def test_custom_keys(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "solution": "s"}])
    (r,) = load_prompt_jsonl(p, prompt_key="question", answer_key="solution")
    assert (r.prompt, r.answer, r.meta) == ("q", "s", {})


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ('{"prompt": "x", "answer": 1', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"answer": 1}', "neither 'prompt' nor 'messages'"),
        ('{"prompt": 5, "answer": 1}', "'prompt' must be a string"),
        ('{"messages": [], "answer": 1}', "non-empty list of messages"),
        ('{"messages": [{"role": "user"}], "answer": 1}', "messages[0] must be an object"),
        ('{"prompt": "x"}', "no answer field 'answer'"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad, fragment):
    p = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": 1}, "", bad])
    with pytest.raises(DatasetError) as e:
        load_prompt_jsonl(p)
    assert f"{p}:3:" in str(e.value) and fragment in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match="no such prompt file"):
        load_prompt_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(DatasetError, match="holds no prompts"):
        load_prompt_jsonl(tmp_path / "e.jsonl")


class FakeChatTokenizer:
    """Records what it was asked to template (the real-template path is tested with the toy
    tokenizer below)."""

    chat_template = "{{ fake }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "|".join(f"{m['role']}={m['content']}" for m in messages) + "|assistant="


def test_render_paths():
    plain = PromptRecord(index=0, prompt="rev 12=")
    chat = PromptRecord(index=1, messages=[{"role": "user", "content": "hi"}])
    tok = FakeChatTokenizer()
    assert render_prompt(plain) == "rev 12="
    assert render_prompt(plain, tok, chat_template=False) == "rev 12="
    assert render_prompt(plain, tok) == "user=rev 12=|assistant="
    assert render_prompt(chat, tok, system_prompt="be brief") == (
        "system=be brief|user=hi|assistant="
    )
    assert render_prompt(chat, None) == "user: hi\nassistant: "
    # A record that brings its own system message keeps it.
    sys_chat = PromptRecord(
        index=2, messages=[{"role": "system", "content": "A"}, {"role": "user", "content": "q"}]
    )
    assert render_prompt(sys_chat, tok, system_prompt="B") == "system=A|user=q|assistant="


def test_real_chat_template_and_encode(toy_tokenizer):
    import copy

    tok = copy.deepcopy(toy_tokenizer)
    rec = PromptRecord(index=0, prompt="cpy 12=")
    ds = PromptDataset([rec], toy_tokenizer)
    assert ds.render(rec) == "cpy 12="  # no template: plain text
    assert ds.encode(rec) == [1] + [toy_tokenizer.convert_tokens_to_ids(c) for c in "cpy 12="]
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    ds = PromptDataset([rec], tok)
    assert ds.render(rec) == "<s>user:cpy 12=\n<s>assistant:"
    ids = ds.encode(rec)
    assert ids[0] == 1 and ids.count(1) == 2  # the template's own <s>, none added on top


def test_max_prompt_tokens(toy_tokenizer):
    recs = [PromptRecord(index=0, prompt="12345")]
    PromptDataset(recs, toy_tokenizer, max_prompt_tokens=6)  # 5 chars + <s>
    with pytest.raises(DatasetError, match="data.max_prompt_tokens=5"):
        PromptDataset(recs, toy_tokenizer, max_prompt_tokens=5)


def test_from_config(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"q": "x", "a": "1"}, {"q": "y", "a": "2"}])
    cfg = load_config(
        None,
        ["model.hf_path=/m", f"data.train_path={p}", "data.prompt_key=q", "data.answer_key=a"],
    )
    ds = PromptDataset.from_config(cfg.data)
    assert [r.prompt for r in ds] == ["x", "y"] and ds[1].answer == "2"


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(50, seed=3, epoch=0)
    assert sorted(a) == list(range(50)) and a != list(range(50))
    assert a == epoch_order(50, seed=3, epoch=0)
    assert a != epoch_order(50, seed=3, epoch=1) and a != epoch_order(50, seed=4, epoch=0)
    assert epoch_order(5, seed=3, epoch=2, shuffle=False) == [0, 1, 2, 3, 4]


def test_epoch_order_is_stable_across_processes():
    # Salted hash() would differ between interpreters; the order must not.
    code = "from megatron_gspo.data import epoch_order; print(epoch_order(20, 7, 2))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(h), "PATH": ""},
            cwd=str(__import__("pathlib").Path(__file__).parents[2]),
        ).stdout
        for h in (1, 2)
    }
    assert outs == {str(epoch_order(20, 7, 2)) + "\n"}


def records(n):
    return [PromptRecord(index=i, prompt=f"p{i}", answer=i) for i in range(n)]


def test_loader_covers_each_epoch_once():
    loader = PromptLoader(records(10), prompts_per_rollout=4, seed=1)
    flat = [r.index for _ in range(5) for r in loader.next_batch()]  # 20 = two epochs
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled
    assert flat[:10] == epoch_order(10, 1, 0) and flat[10:] == epoch_order(10, 1, 1)
    assert (loader.epoch, loader.offset) == (1, 10)  # the next epoch starts lazily


def test_loader_batch_larger_than_dataset():
    loader = PromptLoader(records(3), prompts_per_rollout=7, seed=0, shuffle=False)
    assert loader.next_indices() == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("stop_after", [0, 1, 3, 5])
def test_resume_yields_the_same_remaining_prompts(stop_after):
    reference = PromptLoader(records(11), prompts_per_rollout=3, seed=5)
    expected = [reference.next_indices() for _ in range(9)]

    first = PromptLoader(records(11), prompts_per_rollout=3, seed=5)
    got = [first.next_indices() for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it
    resumed = PromptLoader(records(11), prompts_per_rollout=3, seed=5)
    resumed.load_state_dict(state)
    got += [resumed.next_indices() for _ in range(9 - stop_after)]
    assert got == expected


def test_resume_refuses_a_different_dataset_or_seed():
    state = PromptLoader(records(11), prompts_per_rollout=3, seed=5).state_dict()
    with pytest.raises(ValueError, match="num_prompts=11"):
        PromptLoader(records(12), prompts_per_rollout=3, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=5"):
        PromptLoader(records(11), prompts_per_rollout=3, seed=6).load_state_dict(state)
