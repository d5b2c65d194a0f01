"""Generated corrupt inputs across the classes of docs/reliability.md "Input classes" (issue 40):
every case ends in one `ConfigError` line (exit code 2, `user_errors.exit_code`) from the
start-up validation (`preflight`, what the launcher and every rank run before a model is built
or an engine starts), writes nothing and starts nothing.

The cases are generated, not listed: every way `_corrupt_files` damages a real tiny model
directory (the one `tools/make_tiny_toy.py` writes), every way `_bad_prompt_files` damages the
prompt file, every budget no prompt fits (`FIT_CASES`, with the toy's tokenizer), an empty
value for every string key of the config (walked from the dataclasses),
every key a resume may not change (`FIXED_ON_RESUME`) plus a step count below the checkpoint's,
and disk states (no room for a checkpoint, a checkpoint directory under a file, a `latest`
naming nothing). `test_there_are_at_least_50_cases` counts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import struct
import sys
import threading
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_gspo.checkpoint.files import OPTIMIZER_FILE, RUN_CONFIG
from megatron_gspo.checkpoint.resume import FIXED_ON_RESUME
from megatron_gspo.config import Config, config_from_dict
from megatron_gspo.config_io import ConfigError
from megatron_gspo.patches.optimizer import planned_optimizer
from megatron_gspo.run import preflight as preflight_module
from megatron_gspo.run.preflight import preflight
from megatron_gspo.run.user_errors import exit_code
from tools import make_tiny_toy

Case = Callable[[Path], tuple[dict[str, Any], bool]]  # tmp -> (config overrides, resume)


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy")
    make_tiny_toy.main(["--out", str(out / "toy"), "--n", "8"])
    return out / "toy"


def _config(tmp: Path, toy: Path, over: dict[str, Any]) -> Config:
    base: dict[str, Any] = {
        "model": {"hf_path": str(tmp / "model"), "dtype": "fp32"},
        "data": {"train_path": str(tmp / "toy.jsonl")},
        "train": {"device": "cpu"},
        "reward": {"kind": "toy"},
        "rollout": {"max_new_tokens": 16},  # the toy's context is 512 tokens
        "logging": {"dir": str(tmp / "run")},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    for key, value in over.items():
        section, _, name = key.rpartition(".")
        node = base
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[name] = value
    return config_from_dict(base)


def _prepare(tmp: Path, toy: Path) -> None:
    shutil.copytree(toy / "model", tmp / "model")
    shutil.copy(toy / "toy.jsonl", tmp / "toy.jsonl")


# ---- the model directory: every way of damaging a real one ---------------------------------


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    raw = path.read_bytes()
    n, header = _header(path)
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (n - len(text)) if len(text) <= n else b""
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _poke(path: Path, name: str, value: float, last: bool = False) -> None:
    raw = bytearray(path.read_bytes())
    n, header = _header(path)
    begin, end = header[name]["data_offsets"]
    at = 8 + n + (end - 4 if last else begin)
    raw[at : at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))


def _split_into_index(model: Path, lacking: bool = False, missing: bool = False) -> None:
    """model.safetensors -> model-00001-of-00001.safetensors + an index naming it (and, with
    `missing`, a second shard that is not there; with `lacking`, a tensor the shard lacks)."""
    shard = model / "model-00001-of-00001.safetensors"
    (model / "model.safetensors").rename(shard)
    _, header = _header(shard)
    weight_map = {k: shard.name for k in header if k != "__metadata__"}
    if missing:
        weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    if lacking:
        weight_map["model.layers.9.mlp.gate.weight"] = shard.name
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


W = "model.safetensors"
FILE_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "shard-missing": (lambda m: _split_into_index(m, missing=True), "missing, but"),
    "shard-lacks-tensor": (lambda m: _split_into_index(m, lacking=True), "lacks 1 tensor"),
    "index-no-weight-map": (
        lambda m: (m / "model.safetensors.index.json").write_text("{}"),
        "has no 'weight_map'",
    ),
    "index-not-json": (
        lambda m: (m / "model.safetensors.index.json").write_text("{"),
        "cannot be read as JSON",
    ),
    "zero-bytes": (lambda m: (m / W).write_bytes(b""), "empty (0 bytes"),
    "four-bytes": (lambda m: (m / W).write_bytes(b"\0\0\0\0"), "too short"),
    "truncated": (
        lambda m: (m / W).write_bytes((m / W).read_bytes()[:-100]),
        "(truncated)",
    ),
    "header-length-garbage": (
        lambda m: (m / W).write_bytes(b"\xff" * 8 + (m / W).read_bytes()[8:]),
        "not a safetensors file",
    ),
    "header-not-json": (
        lambda m: (m / W).write_bytes(
            (m / W).read_bytes()[:8] + b"#" + (m / W).read_bytes()[9:]
        ),
        "header is not valid JSON",
    ),
    "header-entry-malformed": (
        lambda m: _rewrite_header(m / W, lambda h: h["lm_head.weight"].update(shape="64x128")),
        "malformed header entry",
    ),
    "header-span-wrong": (
        lambda m: _rewrite_header(m / W, lambda h: h["lm_head.weight"].update(shape=[127, 64])),
        "its shape needs",
    ),
    "unknown-dtype": (
        lambda m: _rewrite_header(m / W, lambda h: h["lm_head.weight"].update(dtype="F7")),
        "malformed header entry",
    ),
    "int-weight": (
        lambda m: _rewrite_header(m / W, lambda h: h["lm_head.weight"].update(dtype="I32")),
        "not a float type",
    ),
    "inf-first-value": (lambda m: _poke(m / W, "lm_head.weight", float("inf")), "inf or NaN"),
    "nan-last-value": (
        lambda m: _poke(m / W, "model.norm.weight", float("nan"), last=True),
        "inf or NaN",
    ),
    "vocab-differs": (
        lambda m: _edit_json(m / "config.json", vocab_size=256),
        "[vocab_size, hidden_size]",
    ),
    "hidden-differs": (
        lambda m: _edit_json(m / "config.json", hidden_size=32),
        "[vocab_size, hidden_size]",
    ),
    "layers-differ": (
        lambda m: _edit_json(m / "config.json", num_hidden_layers=4),
        "num_hidden_layers=4",
    ),
    "tokenizer-past-vocab": (
        lambda m: _edit_json(
            m / "tokenizer.json",
            added_tokens=[*json.loads((m / "tokenizer.json").read_text())["added_tokens"],
                          {"id": 500, "content": "<x>", "special": True}],
        ),
        "token id 500 is past",
    ),
    "tokenizer-not-json": (
        lambda m: (m / "tokenizer.json").write_text("{"),
        "cannot be read as JSON",
    ),
    # was: preflight passed, rank 0's rollout failed in AutoTokenizer's traceback after the
    # engines had started
    "tokenizer-missing": (
        lambda m: [(m / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        "no tokenizer (tokenizer.json / tokenizer_config.json / tokenizer.model / vocab.json "
        "absent), the rollout reads prompts and responses with it; add them, or set "
        "model.tokenizer_path",
    ),
    "config-missing": (lambda m: (m / "config.json").unlink(), "config.json: missing"),
    "config-not-json": (lambda m: (m / "config.json").write_text("{"), "not valid JSON"),
    "no-weights": (lambda m: (m / W).unlink(), "no *.safetensors or *.bin weights"),
    "model-dir-missing": (lambda m: shutil.rmtree(m), "no such directory"),
    "model-dir-is-a-file": (
        lambda m: (shutil.rmtree(m), m.write_text("")),
        "not a directory",
    ),
}

PROMPT_CASES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "holds no prompts"),
    "blank-lines": (b"\n\n  \n", "holds no prompts"),
    "not-utf8": (b'{"prompt": "a\xe9", "answer": "1"}\n', "not UTF-8"),
    "not-json": (b'{"prompt": "1", "answer": "1"}\n{"prompt": \n', "invalid JSON"),
    "a-list": (b"[1, 2]\n", "expected a JSON object"),
    "no-prompt": (b'{"question": "1", "answer": "1"}\n', "neither 'prompt' nor 'messages'"),
    "no-answer": (b'{"prompt": "1"}\n', "no answer field"),
    "prompt-not-str": (b'{"prompt": 12, "answer": "1"}\n', "'prompt' must be a string"),
    "messages-empty": (b'{"messages": [], "answer": "1"}\n', "non-empty list of messages"),
}


# Budgets no prompt fits, with the run's tokenizer (was: found on rank 0 once the engines had
# started, issue 40): a micro-batch, the prompt cap, the engine's context, a stop text.
FIT_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "micro-batch": (
        {"train.micro_batch_tokens": 5, "rollout.max_new_tokens": 4},
        "are longer than train.micro_batch_tokens=5 with 4 response tokens",
    ),
    "max-prompt-tokens": ({"data.max_prompt_tokens": 1}, "longer than data.max_prompt_tokens=1"),
    "engine-context": (
        {"rollout.launch.extra_args": ["--context-length", "6"], "rollout.max_new_tokens": 4},
        "the engine's context of 6 tokens",
    ),
    "turn-stop-not-one-token": (
        {"rollout.env": "megatron_gspo.envs.calculator:Calculator", "rollout.turn_stop": ["ab"]},
        "rollout.turn_stop entry 'ab' is 2 tokens",
    ),
}


def _string_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every string key whose default is not "" (those refuse an empty value)."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        union = typing.get_origin(tp) in (typing.Union, types.UnionType)
        for arm in typing.get_args(tp) if union else (tp,):
            if dataclasses.is_dataclass(arm):
                keys += _string_keys(arm, f"{key}.")  # type: ignore[arg-type]
            elif arm is str and f.default != "":
                keys.append(key)
    return keys


EMPTY_KEYS = _string_keys()
RESUME_CHANGES: dict[str, Any] = {
    "optim.optimizer": "sgd",
    "optim.use_distributed_optimizer": False,
    "data.train_path": "OTHER",
    "data.format": "parquet",
    "data.seed": 7,
    "data.shuffle": False,
    "data.max_prompt_tokens": 99,
}


def _checkpoint(tmp: Path, cfg: Config, step: int = 2) -> None:
    """The files preflight reads of a checkpoint the trainer wrote at `step`."""
    path = tmp / "ckpt" / f"step_{step:06d}"
    (path / "hf_config").mkdir(parents=True)
    shutil.copy(tmp / "model" / "config.json", path / "hf_config" / "config.json")
    meta = {"source": str(tmp / "model"), "layout": {"ep": 1}, "world_size": 1}
    (path / "mgspo_conversion.json").write_text(json.dumps(meta))
    (path / RUN_CONFIG).write_text(json.dumps(cfg.to_dict()))
    (tmp / "ckpt" / "latest").write_text(path.name)


def _tree(root: Path) -> set[tuple[str, int]]:
    return {(str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1)
            for p in root.rglob("*")}


def _children() -> set[str]:
    """This process's child processes (every thread's), from /proc."""
    found: set[str] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            found |= set((task / "children").read_text().split())
    return found


def _refused(tmp: Path, cfg: Config, resume: bool, expected: str) -> str:
    """preflight refuses with one line containing `expected`, exit code 2, before any model is
    built (no megatron module imported by it), writing nothing (no file created or changed
    under the test's directory, the run directories absent) and starting nothing (no thread,
    no child process)."""
    before, threads, children = _tree(tmp), threading.active_count(), _children()
    modules = {m for m in sys.modules if m.startswith("megatron.")}
    with pytest.raises(ConfigError) as e:
        preflight(cfg, resume=resume, overwrite=False, world_size=1)
    msg = str(e.value)
    assert "\n" not in msg and expected in msg, (expected, msg)
    assert exit_code(e.value) == 2
    assert _tree(tmp) == before and threading.active_count() == threads
    assert _children() <= children
    assert not (tmp / "run").exists() and (resume or not (tmp / "ckpt").exists())
    assert {m for m in sys.modules if m.startswith("megatron.")} <= modules
    return msg


def test_the_untouched_toy_passes(tmp_path: Path, toy: Path) -> None:
    """Each case below differs from this valid start by its one damage."""
    _prepare(tmp_path, toy)
    cfg = _config(tmp_path, toy, {})
    tokenizer = preflight(cfg, resume=False, overwrite=False, world_size=1)
    # the run's tokenizer, loaded once here and handed on to the rollout (`make_rollout`)
    from transformers import AutoTokenizer

    text = "rev 3812="
    assert tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(
        str(tmp_path / "model")
    )(text)["input_ids"]
    _checkpoint(tmp_path, cfg)
    preflight(_config(tmp_path, toy, {}), resume=True, overwrite=False, world_size=1)


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_model_files(tmp_path: Path, toy: Path, case: str) -> None:
    _prepare(tmp_path, toy)
    damage, expected = FILE_CASES[case]
    damage(tmp_path / "model")
    _refused(tmp_path, _config(tmp_path, toy, {}), False, expected)


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_prompt_files(tmp_path: Path, toy: Path, case: str) -> None:
    _prepare(tmp_path, toy)
    content, expected = PROMPT_CASES[case]
    (tmp_path / "toy.jsonl").write_bytes(content)
    _refused(tmp_path, _config(tmp_path, toy, {}), False, expected)


@pytest.mark.parametrize("case", sorted(FIT_CASES))
def test_budgets_no_prompt_fits(tmp_path: Path, toy: Path, case: str) -> None:
    _prepare(tmp_path, toy)
    over, expected = FIT_CASES[case]
    _refused(tmp_path, _config(tmp_path, toy, over), False, expected)


def test_tokenizer_path_without_a_tokenizer(tmp_path: Path, toy: Path) -> None:
    """model.tokenizer_path naming a directory without tokenizer files (was: preflight passed)."""
    _prepare(tmp_path, toy)
    (tmp_path / "tok").mkdir()
    cfg = _config(tmp_path, toy, {"model.tokenizer_path": str(tmp_path / "tok")})
    msg = _refused(tmp_path, cfg, False, f"{tmp_path / 'tok'}: no tokenizer")
    assert msg.endswith("; change model.tokenizer_path"), msg


def test_missing_prompt_file(tmp_path: Path, toy: Path) -> None:
    _prepare(tmp_path, toy)
    (tmp_path / "toy.jsonl").unlink()
    _refused(tmp_path, _config(tmp_path, toy, {}), False, "no such prompt file")


@pytest.mark.parametrize("key", EMPTY_KEYS)
def test_an_empty_string_value(tmp_path: Path, toy: Path, key: str) -> None:
    """`key=` (was: `checkpoint.dir=` with save_every trained and wrote nothing, silently)."""
    _prepare(tmp_path, toy)
    with pytest.raises(ConfigError) as e:
        _config(tmp_path, toy, {key: ""})
    msg = str(e.value)
    assert "\n" not in msg and f"{key}='' is empty" in msg and exit_code(e.value) == 2, msg


def test_the_empty_keys_walk() -> None:
    assert {"checkpoint.dir", "logging.dir", "model.hf_path", "data.train_path"} <= set(
        EMPTY_KEYS
    )
    assert "rollout.launch.model_path" not in EMPTY_KEYS  # "" is its documented default


@pytest.mark.parametrize("key", sorted(RESUME_CHANGES))
def test_resume_changing_a_fixed_key(tmp_path: Path, toy: Path, key: str) -> None:
    _prepare(tmp_path, toy)
    _checkpoint(tmp_path, _config(tmp_path, toy, {}))
    value = RESUME_CHANGES[key]
    if value == "OTHER":
        shutil.copy(tmp_path / "toy.jsonl", tmp_path / "other.jsonl")
        value = str(tmp_path / "other.jsonl")
    if key == "data.format":  # parquet of the same prompts: the file must be read that way
        pytest.importorskip("pyarrow")
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [json.loads(x) for x in (tmp_path / "toy.jsonl").read_text().splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "toy.parquet")
        cfg = _config(tmp_path, toy, {key: value, "data.train_path": str(tmp_path / "toy.parquet")})
    else:
        cfg = _config(tmp_path, toy, {key: value})
    assert key in FIXED_ON_RESUME
    _refused(tmp_path, cfg, True, "on resume, the checkpoint")


def test_resume_with_fewer_steps_than_the_checkpoint(tmp_path: Path, toy: Path) -> None:
    """Was: engines started, weights pushed, exit 0 having trained nothing."""
    _prepare(tmp_path, toy)
    _checkpoint(tmp_path, _config(tmp_path, toy, {}), step=4)
    cfg = _config(tmp_path, toy, {"train.steps": 3})
    _refused(tmp_path, cfg, True, "train.steps=3 is below the step of the checkpoint")


def test_resume_of_another_optimizers_state(tmp_path: Path, toy: Path) -> None:
    """A checkpoint whose Adam steps were kept per param group (Transformer Engine's FusedAdam,
    a GPU run) resumed where megatron-core builds torch's AdamW (per parameter), and the other
    way round (was: accepted here; only the load, once the model and optimizer were built, met
    the saved steps, which `restore_adam_steps` pairs strictly with the parameters or groups:
    read from the code, not run, as no Transformer Engine installs here)."""
    _prepare(tmp_path, toy)
    cfg = _config(tmp_path, toy, {})
    _checkpoint(tmp_path, cfg)
    te = "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam"
    here = planned_optimizer("adam")
    saved = "torch.optim.adamw.AdamW" if here == te else te
    step = tmp_path / "ckpt" / "step_000002"
    (step / OPTIMIZER_FILE).write_text(json.dumps({"classes": [saved, saved]}))
    msg = _refused(tmp_path, cfg, True, f"{step}: its optimizer state was written by {saved}")
    assert f"this run builds {here}" in msg
    (step / OPTIMIZER_FILE).write_text(json.dumps({"classes": [here, here]}))
    preflight(cfg, resume=True, overwrite=False, world_size=1)  # the same optimizer resumes


def test_no_room_for_a_checkpoint(tmp_path: Path, toy: Path, monkeypatch) -> None:
    _prepare(tmp_path, toy)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        preflight_module.shutil, "disk_usage", lambda p: usage._replace(free=100_000)
    )
    _refused(tmp_path, _config(tmp_path, toy, {}), False, "one checkpoint takes at least")


def test_checkpoint_dir_under_a_file(tmp_path: Path, toy: Path) -> None:
    _prepare(tmp_path, toy)
    (tmp_path / "afile").write_text("")
    cfg = _config(tmp_path, toy, {"checkpoint.dir": str(tmp_path / "afile" / "ckpt")})
    _refused(tmp_path, cfg, False, "afile is not a directory")


def test_latest_naming_nothing(tmp_path: Path, toy: Path) -> None:
    _prepare(tmp_path, toy)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("step_000009")
    _refused(tmp_path, _config(tmp_path, toy, {}), True, "which is not a checkpoint directory")


def test_there_are_at_least_50_cases() -> None:
    n = len(FILE_CASES) + len(PROMPT_CASES) + 2 + len(EMPTY_KEYS) + len(RESUME_CHANGES) + 5
    n += len(FIT_CASES)
    assert n >= 50, n


def test_a_resume_with_changed_keys_keeps_the_previous_config_json(tmp_path: Path) -> None:
    """The record of the run: a resume at step 2 with another config moves the old
    config.json to config.step_000002.json (was: overwritten)."""
    from megatron_gspo.run.metrics_log import MetricsLogger

    kw: dict[str, Any] = {"tensorboard": False, "progress": False, "rank": 0}
    MetricsLogger(tmp_path, config={"optim": {"lr": 1}}, start_step=0, **kw).close()
    MetricsLogger(tmp_path, config={"optim": {"lr": 1}}, start_step=2, **kw).close()
    assert not (tmp_path / "config.step_000002.json").exists()  # unchanged: nothing to keep
    MetricsLogger(tmp_path, config={"optim": {"lr": 2}}, start_step=2, **kw).close()
    assert json.loads((tmp_path / "config.step_000002.json").read_text()) == {"optim": {"lr": 1}}
    assert json.loads((tmp_path / "config.json").read_text()) == {"optim": {"lr": 2}}


@pytest.mark.parametrize("where", ["mkdir", "lock-file"])
def test_a_full_disk_at_the_run_dir_lock_is_one_line(
    tmp_path: Path, toy: Path, monkeypatch, where: str
) -> None:
    """A full disk when rank 0 takes the run-directory lock (after preflight: the disk filled
    since). Was: an `OSError: [Errno 28] No space left on device` traceback from the lock."""
    import errno

    from megatron_gspo.run import run_dir

    _prepare(tmp_path, toy)
    cfg = _config(tmp_path, toy, {})
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def no_space(*args: Any, **kwargs: Any) -> Any:
        raise full

    if where == "mkdir":
        monkeypatch.setattr(run_dir.Path, "mkdir", no_space)
    else:
        monkeypatch.setattr(run_dir.os, "open", no_space)
    with pytest.raises(ConfigError) as e:
        run_dir.RunLock.acquire(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and "logging.dir" in msg, msg
    assert exit_code(e.value) == 2
