"""Bad input to `megatron_gspo.train`: each case ends in one `ConfigError` line naming the file,
line or key (printed by `train.cli` with exit code 2 and no traceback), before megatron-core or
any engine starts. The cases are the table of docs/reliability.md.

In-process: `load_config` / `parse_cli` and `preflight` (what `train.main` runs on every rank
before `init_distributed`). Subprocess: the entry point itself, a 1-rank job without torchrun.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_gspo.config import Config, ConfigError, load_config, parse_cli
from megatron_gspo.data.prompts import PromptDataset, load_prompt_jsonl
from megatron_gspo.data.toy import save_toy_tokenizer
from megatron_gspo.run.metrics_log import MetricsLogger, read_metrics
from megatron_gspo.run.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
HF_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
}


def _base(tmp: Path) -> dict:
    """A valid config (model dir, data file, run dirs under `tmp`) as a nested dict."""
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(HF_CONFIG))
    # a valid safetensors file holding no tensor (preflight reads every weight file's header)
    (model / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    save_toy_tokenizer(model)  # preflight loads the run's tokenizer (and refuses none)
    data = tmp / "data.jsonl"
    data.write_text('{"prompt": "12", "answer": "12"}\n{"prompt": "3", "answer": "3"}\n')
    return {
        "model": {"hf_path": str(model), "dtype": "fp32"},
        "data": {"train_path": str(data)},
        "train": {"device": "cpu"},
        "reward": {"kind": "toy"},
        "logging": {"dir": str(tmp / "run")},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }


def _write(tmp: Path, data: dict, name: str = "run.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def _check(cfg: Config, *, world_size: int = 1, resume: bool = False, overwrite: bool = False):
    preflight(cfg, resume=resume, overwrite=overwrite, world_size=world_size)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg  # one line: the console shows exactly this
    return msg


def test_the_valid_base_passes(tmp_path: Path) -> None:
    """The fixture is valid, so every failure below is caused by its one change."""
    _check(load_config(_write(tmp_path, _base(tmp_path))))


# ---- the config file -------------------------------------------------------------------------


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "nope.yaml")
    assert _one_line(e) == f"{tmp_path}/nope.yaml: no such config file (--config)"


def test_config_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert "is a directory" in _one_line(e)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  hf_path: m\ndata: [unclosed\n  x: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = _one_line(e)
    assert msg.startswith(f"{path}:") and "YAML syntax error" in msg
    line = int(msg.split(":")[1])
    assert 3 <= line <= 5, msg


def test_config_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model:\n  hf_path: caf\xe9\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert _one_line(e) == f"{path}:2: not UTF-8 text (byte 0xe9)"


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_config_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert _one_line(e).startswith(f"{path}: the top level must be a mapping")


def test_unknown_key_in_file_and_in_set(tmp_path: Path) -> None:
    data = _base(tmp_path)
    data["optim"] = {"lrr": 1e-3}
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, data))
    assert "unknown config key 'optim.lrr'; did you mean 'optim.lr'?" in _one_line(e)
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, _base(tmp_path)), ["optim.lrr=1"])
    assert "unknown config key 'optim.lrr' in --set optim.lrr=1" in _one_line(e)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lr=fast", "optim.lr='fast' must be a number; change optim.lr"),
        ("model.dtype=fp64", "model.dtype='fp64' is not one of bf16 | fp16 | fp32"),
        ("optim", "override 'optim' is not of the form section.key=value"),
        ("reward.kind=mymodule", 'is not math, toy, pattern, http or "module:function"'),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, _base(tmp_path)), [override])
    assert expected in _one_line(e)


def test_missing_required_key(tmp_path: Path) -> None:
    data = _base(tmp_path)
    del data["data"]
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, data))
    assert _one_line(e) == "missing required config key 'data'; set data"


def test_resume_and_overwrite_together_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_cli(["--resume", "--overwrite"])
    assert e.value.code == 2
    assert "--resume and --overwrite contradict each other" in capsys.readouterr().err


# ---- the model directory ---------------------------------------------------------------------


def test_nonexistent_model_path(tmp_path: Path) -> None:
    """Was a Hugging Face hub validation traceback (the path read as a repo id)."""
    cfg = load_config(_write(tmp_path, _base(tmp_path)), ["model.hf_path=Qwen/nope"])
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith("model.hf_path=Qwen/nope: no such directory")


def test_model_dir_without_config_json(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _base(tmp_path)))
    (tmp_path / "model/config.json").unlink()
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith(f"{tmp_path}/model/config.json: missing; model.hf_path=")


def test_model_config_json_not_json(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _base(tmp_path)))
    (tmp_path / "model/config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith(f"{tmp_path}/model/config.json: not valid JSON")


def test_model_dir_without_weights(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _base(tmp_path)))
    (tmp_path / "model/model.safetensors").unlink()
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert "no *.safetensors or *.bin weights" in _one_line(e)
    cfg.model.load_weights = False  # random weights: config.json is enough
    _check(cfg)


def test_missing_tokenizer_path(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _base(tmp_path)), [f"model.tokenizer_path={tmp_path}/t"])
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith(f"model.tokenizer_path={tmp_path}/t: no such directory")


def test_fp16_on_cpu(tmp_path: Path) -> None:
    """Was a ValueError from make_provider after megatron-core had started (a checksum error
    before that). bf16 runs on CPU (issue 35: the recipes' precision in the rehearsals)."""
    cfg = load_config(_write(tmp_path, _base(tmp_path)), ["model.dtype=fp16"])
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith("model.dtype=fp16 on CPU")
    _check(load_config(_write(tmp_path, _base(tmp_path)), ["model.dtype=bf16"]))


@pytest.mark.parametrize(
    ("sets", "world", "expected"),
    [
        (["parallel.tp=2"], 3, "world size 3 is not divisible by tp*pp*cp"),
        (["parallel.ep=3"], 3, "parallel.ep=3 does not divide the model's num_experts=4"),
        (["parallel.tp=4"], 4, "parallel.tp=4 does not divide the model's num_key_value_heads"),
        (["parallel.pp=4"], 4, "does not divide the model's num_hidden_layers=2"),
    ],
)
def test_layout_that_does_not_fit(tmp_path: Path, sets: list[str], world: int, expected: str):
    """Checked before megatron-core is initialised (which would fail with its own message)."""
    cfg = load_config(_write(tmp_path, _base(tmp_path)), sets)
    with pytest.raises(ConfigError) as e:
        _check(cfg, world_size=world)
    assert expected in _one_line(e)


# ---- the prompt file -------------------------------------------------------------------------


def _data_case(tmp_path: Path, content: bytes | None) -> pytest.ExceptionInfo:
    cfg = load_config(_write(tmp_path, _base(tmp_path)))
    path = Path(cfg.data.train_path)
    if content is None:
        path.unlink()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    return e


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "data.jsonl: no such prompt file (data.train_path)"),
        (b"", "data.jsonl: the file holds no prompts"),
        (b"\n  \n", "data.jsonl: the file holds no prompts"),
        (b'{"prompt": "a", "answer": 1}\n{"prompt": "caf\xe9"}\n', "data.jsonl:2: not UTF-8 text"),
        (b'{"prompt": "a", "answer": 1}\n{"prompt": "a",\n', "data.jsonl:2: invalid JSON"),
        (b'{"text": "a", "answer": 1}\n', "data.jsonl:1: neither 'prompt' nor 'messages'"),
        (b'["a"]\n', "data.jsonl:1: expected a JSON object, got list"),
        (b'{"prompt": "a"}\n', "data.jsonl:1: no answer field 'answer'"),
        (b'{"prompt": 3, "answer": 1}\n', "data.jsonl:1: 'prompt' must be a string"),
        (b'{"messages": [], "answer": 1}\n', "data.jsonl:1: 'messages' must be a non-empty"),
    ],
)
def test_bad_prompt_file(tmp_path: Path, content: bytes | None, expected: str) -> None:
    assert _one_line(_data_case(tmp_path, content)).startswith(f"{tmp_path}/{expected}")


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": 1}\n')
    assert load_prompt_jsonl(path)[0].prompt == "a"


def test_overlong_prompts_are_dropped_with_a_count(tmp_path: Path, toy_tokenizer, capsys) -> None:
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "x" * n, "answer": "a"} for n in (2, 50, 3, 60)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = load_prompt_jsonl(path)
    ds = PromptDataset(
        records, toy_tokenizer, chat_template=False, max_prompt_tokens=10, source=str(path)
    )
    assert [r.prompt for r in ds] == ["xx", "xxx"] and ds.num_too_long == 2
    err = capsys.readouterr().err
    assert f"{path}: dropped 2 of 4 prompts longer than data.max_prompt_tokens=10" in err
    with pytest.raises(ConfigError) as e:  # none left: refused
        PromptDataset(records, toy_tokenizer, chat_template=False, max_prompt_tokens=1)
    assert "all 4 prompts are longer than data.max_prompt_tokens=1" in _one_line(e)


# ---- the reward ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["no_such_module_xyz:score", "no_such_pkg_xyz.sub:score"])
def test_reward_module_that_cannot_be_imported(tmp_path: Path, kind: str) -> None:
    cfg = load_config(_write(tmp_path, _base(tmp_path)), [f"reward.kind={kind}"])
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith(f"reward.kind={kind!r}: cannot import it")


def test_reward_module_is_located_not_imported(tmp_path: Path, monkeypatch) -> None:
    """User code runs in the reward workers only: preflight must not execute it."""
    (tmp_path / "my_reward_mod.py").write_text("raise SystemExit('imported!')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _check(load_config(_write(tmp_path, _base(tmp_path)), ["reward.kind=my_reward_mod:score"]))
    assert "my_reward_mod" not in sys.modules


# ---- the run directory -----------------------------------------------------------------------


def test_previous_run_is_refused_without_resume_or_overwrite(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, _base(tmp_path)))
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    _check(cfg)  # empty (or absent) directories are fine
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    msg = _one_line(e)
    assert msg.startswith(f"{run}/metrics.jsonl: a previous run is there")
    assert "--resume" in msg and "--overwrite" in msg
    (run / "metrics.jsonl").unlink()
    (ckpt / "step_000002").mkdir(parents=True)
    # the layout it was written at (preflight compares it with this run's on --resume)
    (ckpt / "step_000002" / "mgspo_conversion.json").write_text('{"layout": {}, "world_size": 1}')
    (ckpt / "latest").write_text("step_000002")
    with pytest.raises(ConfigError) as e:
        _check(cfg)
    assert _one_line(e).startswith(f"{ckpt}/latest: a previous run is there")
    _check(cfg, resume=True)  # continuing it is fine, and touches nothing
    assert (ckpt / "latest").exists()


# --overwrite: tests/run/test_run_dir.py (nothing is deleted before the run has started)


def test_resumed_metrics_do_not_repeat_steps(tmp_path: Path) -> None:
    """The interrupted run logged steps 1-5 but its checkpoint is at step 3 (and its last line
    was cut by the kill); the resumed run logs 4-6 again: each step once, the new values."""
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "lo')
    with MetricsLogger(tmp_path, tensorboard=False, progress=False, rank=0, start_step=3) as m:
        for s in (4, 5, 6):
            m.log(s, {"loss": 10.0 * s})
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[3]["loss"] == 3.0 and rows[4]["loss"] == 40.0


# ---- the entry point -------------------------------------------------------------------------


def _train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a 1-rank job, as a user would start it without torchrun
    return subprocess.run(
        [sys.executable, "-m", "megatron_gspo.train", *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_entry_point_prints_one_line_and_exits_2(tmp_path: Path) -> None:
    """Several bad inputs in one process each (the import costs seconds): exit code 2, stderr is
    exactly one line naming the file or key, no traceback, nothing written to the run dirs."""
    base = _base(tmp_path)
    good = _write(tmp_path, base)
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [\n")
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"prompt": "a", "answer": 1}\nnot json\n')
    cases = [
        (["--config", str(tmp_path / "nope.yaml")], "nope.yaml: no such config file"),
        (["--config", str(bad_yaml)], f"{bad_yaml}:"),
        (["--config", str(good), "--set", "model.hf_path=Qwen/nope"], "model.hf_path=Qwen/nope"),
        (["--config", str(good), "--set", f"data.train_path={bad_data}"], f"{bad_data}:2:"),
        (["--config", str(good), "--set", "model.dtype=fp16"], "model.dtype=fp16 on CPU"),
    ]
    for args, expected in cases:
        r = _train(tmp_path, *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(lines) == 1, (args, r.stderr)
        assert lines[0].startswith("error: ") and expected in lines[0], (args, lines)
    assert not (tmp_path / "run").exists() and not (tmp_path / "ckpt").exists()


def test_entry_point_refuses_a_previous_run(tmp_path: Path) -> None:
    good = _write(tmp_path, _base(tmp_path))
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text('{"step": 1}\n')
    r = _train(tmp_path, "--config", str(good))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        f"error: {tmp_path}/run/metrics.jsonl: a previous run is there; pass --resume to "
        "continue it, --overwrite to replace it, or set logging.dir / checkpoint.dir to a new "
        "directory"
    )
    assert (tmp_path / "run/metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched


# ---- the real SGLang server's interpreter -----------------------------------------------------
def test_sglang_without_an_engine_python_names_the_set_up(tmp_path: Path, monkeypatch) -> None:
    """rollout.launch.backend=sglang with rollout.launch.python unset: the engine venv of
    scripts/engine_env.sh is used when built; without it, an interpreter that cannot import
    SGLang's server stops every rank before anything starts, naming the command that helps."""
    from megatron_gspo.engines.interpreter import sglang_python
    from megatron_gspo.testing import sglang_server

    monkeypatch.delenv(sglang_server.ENGINE_PYTHON_ENV, raising=False)
    monkeypatch.setenv("MGSPO_CACHE", str(tmp_path / "empty_cache"))  # no engine venv built
    no_sglang = tmp_path / "no_sglang"
    no_sglang.write_text("#!/bin/sh\nexit 1\n")  # an interpreter whose imports all fail
    no_sglang.chmod(0o755)
    with pytest.raises(ConfigError) as e:
        sglang_python(fallback=str(no_sglang))
    assert "cannot be imported by" in (msg := _one_line(e))
    assert "run bash scripts/engine_env.sh and set rollout.launch.python" in msg
    data = _base(tmp_path)
    data["rollout"] = {"launch": {"backend": "sglang", "device": "cpu"}}
    cfg = load_config(_write(tmp_path, data))
    missing = tmp_path / "gone/bin/python"
    monkeypatch.setenv(sglang_server.ENGINE_PYTHON_ENV, str(missing))
    with pytest.raises(ConfigError) as e:
        _check(cfg)  # preflight: every rank
    assert f"{sglang_server.ENGINE_PYTHON_ENV}={missing}: no such file" in _one_line(e)
    venv = tmp_path / "venv/bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    monkeypatch.setenv(sglang_server.ENGINE_PYTHON_ENV, str(venv / "python"))
    _check(cfg)
    assert sglang_python() == str(venv / "python")  # what the job launches the server with
