"""Prompt data from Parquet and Hugging Face `datasets` (`data/formats.py`): the same records
written by pyarrow and by `datasets` (save_to_disk, and a CSV data file) read back equal to the
JSONL reader's, chat messages and extra columns included; `auto` picks the format by path;
bad inputs name the path, the row and the key."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.config import load_config
from megatron_gspo.data.formats import load_prompt_records, resolve_format
from megatron_gspo.data.prompts import DatasetError, PromptDataset

ROWS = [
    {"prompt": "copy 12=", "messages": None, "answer": "12", "task": "copy", "level": 1},
    {
        "prompt": None,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "1+1?"},
        ],
        "answer": "2",
        "task": "add",
        "level": 3,
    },
    {"prompt": "copy 7=", "messages": None, "answer": "7", "task": "copy", "level": 2},
]


def _as_tuples(records):
    return [(r.index, r.prompt, r.messages, r.answer, r.meta) for r in records]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = tmp_path_factory.mktemp("formats")
    jsonl = tmp / "p.jsonl"
    # JSONL rows carry only the keys they use; the columnar formats have every column
    jsonl.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in ROWS)
    )
    pq.write_table(pa.Table.from_pylist(ROWS), tmp / "p.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(
        str(tmp / "dict")
    )
    plain = [r for r in ROWS if r["prompt"] is not None]
    (tmp / "p.csv").write_text(
        "prompt,answer,task,level\n"
        + "".join(f"{r['prompt']},{r['answer']},{r['task']},{r['level']}\n" for r in plain)
    )
    return tmp


def test_parquet_and_saved_dataset_rows_equal_the_jsonl_records(files):
    want = _as_tuples(load_prompt_records(files / "p.jsonl"))
    assert want[1][2][1] == {"role": "user", "content": "1+1?"}  # the reference is a chat
    for path, fmt in ((files / "p.parquet", "parquet"), (files / "saved", "hf")):
        for f in (fmt, "auto"):
            # a columnar row also holds the other record kind's column (None): not in meta
            assert _as_tuples(load_prompt_records(path, fmt=f)) == want, (path, f)


def test_a_csv_data_file_through_datasets(files):
    got = load_prompt_records(files / "p.csv", fmt="auto")
    assert [(r.prompt, str(r.answer), r.meta["task"]) for r in got] == [
        ("copy 12=", "12", "copy"),
        ("copy 7=", "7", "copy"),
    ]


def test_auto_resolution_and_bad_inputs_name_path_row_and_key(files, tmp_path):
    assert [resolve_format(files / n, "auto") for n in ("p.jsonl", "p.parquet", "saved")] == [
        "jsonl",
        "parquet",
        "hf",
    ]
    with pytest.raises(DatasetError, match=r"splits \['train'\].*eval\.path.*dict/train"):
        load_prompt_records(files / "dict", fmt="hf", key="eval.path")
    with pytest.raises(DatasetError, match=r"no such prompt file \(eval\.path\)"):
        load_prompt_records(tmp_path / "none.parquet", fmt="auto", key="eval.path")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_prompt_records(bad, fmt="parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"x": 1}]), bad)
    with pytest.raises(DatasetError, match=r"bad\.parquet: row 1: neither 'prompt'"):
        load_prompt_records(bad, fmt="parquet")


def test_the_dataset_of_a_run_follows_data_format(files, toy_tokenizer):
    cfg = load_config(
        None,
        [
            "model.hf_path=m",
            f"data.train_path={files / 'p.parquet'}",
            "data.format=parquet",
            "data.chat_template=false",
        ],
    )
    ds = PromptDataset.from_config(cfg.data, toy_tokenizer)
    assert [r.answer for r in ds] == ["12", "2", "7"]
    held_out = PromptDataset.from_config(
        cfg.data, toy_tokenizer, path=str(files / "p.parquet"), key="eval.path"
    )
    assert len(held_out) == 3
    assert load_config(None, ["model.hf_path=m", "data.train_path=x"]).data.format == "jsonl"
