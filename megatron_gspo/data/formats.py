"""Prompt records from JSONL, Parquet or Hugging Face `datasets` (`data.format`).

Every format yields the same `PromptRecord`s: a row is read like a JSONL object (the prompt or
message column, the answer column, every other column kept in `meta`; `record_from_object`),
so a Parquet file or a saved dataset written from a JSONL file trains on the same prompts.

- `jsonl`: one JSON object per line (`prompts.load_prompt_jsonl`).
- `parquet`: a Parquet file, read with pyarrow.
- `hf`: Hugging Face `datasets`, local only (nothing is downloaded): a directory written by
  `Dataset.save_to_disk` (`load_from_disk`), or a data file `datasets` reads with its packaged
  builders (.json / .jsonl, .csv, .parquet, .arrow: `load_dataset(builder, data_files=...)`,
  built in a temporary cache that is removed afterwards).
- `auto`: by the path: a directory is `hf`, `.parquet` is `parquet`, `.csv` / `.arrow` are
  `hf`, anything else `jsonl`.

    records = load_prompt_records("train.parquet", fmt="auto")
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from megatron_gspo.data.records import (
    DatasetError,
    PromptRecord,
    load_prompt_jsonl,
    record_from_object,
)

__all__ = ["FORMATS", "load_prompt_records", "resolve_format"]

FORMATS = ("jsonl", "parquet", "hf", "auto")
# `datasets`' packaged builders for a single local data file, by suffix.
_HF_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}


def resolve_format(path: str | Path, fmt: str) -> str:
    """The concrete format of `path` (`fmt` unless it is "auto")."""
    if fmt not in FORMATS:
        raise DatasetError(f"data.format={fmt!r} is not one of {FORMATS}; change data.format")
    if fmt != "auto":
        return fmt
    p = Path(path)
    if p.is_dir():
        return "hf"
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    return "hf" if suffix in (".csv", ".arrow") else "jsonl"


def load_prompt_records(
    path: str | Path,
    *,
    fmt: str = "jsonl",
    prompt_key: str = "prompt",
    messages_key: str = "messages",
    answer_key: str = "answer",
    require_answer: bool = True,
    key: str = "data.train_path",
) -> list[PromptRecord]:
    """Read a prompt file or dataset in `fmt` (see the module docstring); a missing path or a
    malformed row raises `DatasetError` naming the path, the row and `key`."""
    path = Path(path)
    fmt = resolve_format(path, fmt)
    if not path.exists():
        raise DatasetError(f"{path}: no such prompt file ({key})")
    if fmt != "hf" and not path.is_file():
        raise DatasetError(
            f"{path}: not a file ({key}, data.format={fmt}); a saved dataset "
            "directory needs data.format=hf or auto"
        )
    keys = dict(
        prompt_key=prompt_key,
        messages_key=messages_key,
        answer_key=answer_key,
        require_answer=require_answer,
    )
    if fmt == "jsonl":
        return load_prompt_jsonl(path, **keys)  # type: ignore[arg-type]
    rows = _parquet_rows(path) if fmt == "parquet" else _hf_rows(path, key)
    records = [record_from_object(row, f"{path}: row {i}", i, **keys) for i, row in enumerate(rows)]  # type: ignore[arg-type]
    if not records:
        raise DatasetError(f"{path}: the dataset holds no prompts ({key})")
    return records


def _parquet_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(f"{path}: not a readable Parquet file ({e})") from None
    return table.to_pylist()


def _hf_rows(path: Path, key: str) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()  # one-off loading bars are noise on the trainer console
    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DatasetError(
                f"{path}: not a dataset saved with save_to_disk ({e}); check {key}"
            ) from None
        if isinstance(ds, datasets.DatasetDict):
            splits = sorted(ds)
            raise DatasetError(
                f"{path}: a DatasetDict with splits {splits}; point {key} at one split's "
                f"directory, e.g. {path / splits[0]}"
            )
        return ds.to_list()
    builder = _HF_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(
            f"{path}: datasets reads {sorted(_HF_BUILDERS)} files or a save_to_disk directory; "
            f"convert the file or change {key}"
        )
    # A throw-away cache: the Arrow copy `datasets` builds is not kept next to the user's data.
    with tempfile.TemporaryDirectory(prefix="mgspo-datasets-") as cache:
        try:
            ds = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
        except Exception as e:  # the builders raise many types (DatasetGenerationError, ...)
            raise DatasetError(f"{path}: datasets could not read it as {builder} ({e})") from None
        return ds.to_list()
