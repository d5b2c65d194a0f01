"""Faults a new user meets (issue 25), in-process: each check against the behaviour before it.

docs/reliability.md, "New-user faults (issue 25)", lists each case with its test; the
end-to-end cases (a run that resumes with another learning rate onto a full disk, an engine
serving another model, rewards that all fail, the README's conversion command) are in
tests/train/test_new_user_e2e.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron_gspo.checkpoint.resume import RUN_CONFIG
from megatron_gspo.checkpoint.write import CheckpointWriteError, WriteState, describe
from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.data.toy import save_toy_tokenizer
from megatron_gspo.engines.weight_names import sglang_checksums
from megatron_gspo.run.preflight import preflight
from megatron_gspo.run.user_errors import EngineModelMismatch, build_policy, exit_code, first_push
from megatron_gspo.weights.checksum import WeightIntegrityError
from megatron_gspo.weights.sync import WeightSyncError
from megatron_gspo.weights.verify import verify_engines

ROOT = Path(__file__).resolve().parents[2]
HF = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "vocab_size": 128,
}


def _model(tmp: Path, name: str, **over: Any) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**HF, **over}))
    # a valid safetensors file holding no tensor (preflight reads every weight file's header)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    save_toy_tokenizer(d)  # preflight loads the run's tokenizer (and refuses none)
    return d


def _cfg(tmp: Path, model: Path, **sections: dict) -> Any:
    data = tmp / "data.jsonl"
    data.write_text('{"prompt": "12", "answer": "12"}\n')
    base: dict[str, dict] = {
        "model": {"hf_path": str(model), "dtype": "fp32"},
        "data": {"train_path": str(data)},
        "train": {"device": "cpu"},
        "reward": {"kind": "toy"},
        "logging": {"dir": str(tmp / "run")},
        "checkpoint": {"dir": str(tmp / "ckpt")},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return config_from_dict(base)


def _checkpoint(tmp: Path, trained_from: Path, run_config: dict | None = None) -> Path:
    """The files preflight reads of a checkpoint the trainer wrote (layout, model, config)."""
    step = tmp / "ckpt" / "step_000002"
    (step / "hf_config").mkdir(parents=True)
    (step / "hf_config" / "config.json").write_text((trained_from / "config.json").read_text())
    layout = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}
    meta = {"source": str(trained_from), "layout": layout, "world_size": 1}
    (step / "mgspo_conversion.json").write_text(json.dumps(meta))
    if run_config is not None:
        (step / RUN_CONFIG).write_text(json.dumps(run_config))
    (tmp / "ckpt" / "latest").write_text(step.name)
    return step


# ---- 1: an engine serving another model --------------------------------------------------
class _Engine:
    def __init__(self, held: dict[str, str], path: str = "/models/three_layers") -> None:
        self.held, self.path = held, path

    def weights_checksum(self) -> dict[str, dict[str, Any]]:
        return {"http://127.0.0.1:1": {"checksums": self.held}}

    def model_paths(self) -> dict[str, str]:
        return {"http://127.0.0.1:1": self.path}


def _sent() -> Any:
    """What the sender computes for TP-1 engines (`WeightSync._checksums`)."""
    from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout

    acc = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)])
    for i in range(2):
        acc.add(f"model.layers.{i}.mlp.gate.weight", torch.full((4, 8), float(i)))
    acc.add("model.norm.weight", torch.ones(8))
    return acc


def test_engine_holding_parameters_the_push_did_not_write_fails_verification() -> None:
    """Case 1: every sent tensor matches, but the engine has a third layer the push never
    wrote (it serves another model). Before: verified. Compared against the engine's own
    checksums of what was sent (HF naming) and SGLang's fused naming."""
    sent = _sent()
    extra = "model.layers.2.mlp.gate.weight"
    hf_named = {**sent.hf, extra: "0" * 16}
    with pytest.raises(WeightIntegrityError, match=r"1 parameters the push did not write: .*"):
        verify_engines([_Engine(hf_named)], sent)  # type: ignore[list-item]
    named = [(f"model.layers.{i}.self_attn.{p}.weight", torch.ones(4, 8)) for i in range(2)
             for p in ("q_proj", "k_proj", "v_proj")]  # fmt: skip
    fused = sglang_checksums(named)
    fused_sent = _sent()
    for n, t in named:
        fused_sent.add(n, t)
    held = {**fused_sent.ranks(1)[0], "model.layers.2.self_attn.qkv_proj.weight": "1" * 16}
    held["model.rotary_emb.cos_sin_cache"] = "2" * 16  # a buffer: not a parameter we send
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused
    with pytest.raises(WeightIntegrityError, match="layers.2.self_attn.qkv_proj"):
        verify_engines([_Engine(held)], fused_sent)  # type: ignore[list-item]
    # the same engine without the extra layer (the buffer stays) verifies
    del held["model.layers.2.self_attn.qkv_proj.weight"]
    verify_engines([_Engine(held)], fused_sent)  # type: ignore[list-item]


@pytest.mark.parametrize(
    "error",
    [
        WeightSyncError("weight sync v1 failed: model.norm.weight: shape (64,) != (96,)"),
        WeightIntegrityError("weight sync checksum mismatch: 'model.norm.weight' differs"),
    ],
    ids=["another-width", "checksum"],
)
def test_first_push_failing_names_both_models(error: Exception) -> None:
    """Cases 1 and 5: the weight sync before step 1 failing is bad input naming the trainer's
    model and each engine's, exit code 2 (before: a WeightSyncError traceback, exit 1)."""
    cfg = type("C", (), {"model": type("M", (), {"hf_path": "/models/toy"})})()

    def push() -> None:
        raise error

    with pytest.raises(EngineModelMismatch) as got:
        first_push(push, cfg, [_Engine({})])
    text = str(got.value)
    assert "http://127.0.0.1:1 serves /models/three_layers" in text, text
    assert "model.hf_path=/models/toy" in text and str(error).split(": ")[-1] in text, text
    assert "\n" not in text and exit_code(got.value) == 2


def test_first_push_failing_on_engines_of_this_run_names_their_layout(tmp_path: Path) -> None:
    """An engine that serves model.hf_path (same directory, another spelling) but whose first
    push fails, e.g. on a TP size the trainer did not expect, is not called "another model":
    the message names the layout keys to check (before: "serve another model")."""
    (tmp_path / "toy").mkdir()
    cfg = type("C", (), {"model": type("M", (), {"hf_path": str(tmp_path / "toy")})})()

    def push() -> None:
        raise WeightSyncError("engine http://127.0.0.1:1: 2 TP ranks, expected 1")

    with pytest.raises(EngineModelMismatch) as got:
        first_push(push, cfg, [_Engine({}, path=f"{tmp_path}/./toy")])
    text = str(got.value)
    assert "another model" not in text and "rollout.launch.tp_size" in text, text
    assert "2 TP ranks, expected 1" in text and exit_code(got.value) == 2
    # the same failure from an engine on another directory is still "another model"
    with pytest.raises(EngineModelMismatch, match="serve another model"):
        first_push(push, cfg, [_Engine({}, path=str(tmp_path / "other"))])


# ---- 2 and 3: resume with a changed config, or another model ----------------------------
def test_resume_with_another_model_is_refused_naming_both(tmp_path: Path) -> None:
    """Case 3: the checkpoint was trained from a 2-layer model, the run names a 3-layer one.
    Before: preflight passed (megatron-core's `Global shape mismatch` traceback later)."""
    two = _model(tmp_path, "two")
    three = _model(tmp_path, "three", num_hidden_layers=3)
    _checkpoint(tmp_path, two)
    cfg = _cfg(tmp_path, three)
    with pytest.raises(ConfigError) as got:
        preflight(cfg, resume=True, overwrite=False, world_size=1)
    text = str(got.value)
    assert f"trained from the model {two}" in text and f"model.hf_path={three}" in text, text
    assert "num_hidden_layers 2 vs 3" in text, text
    preflight(_cfg(tmp_path, two), resume=True, overwrite=False, world_size=1)  # same model


def test_resume_config_changes_are_listed_and_fixed_keys_refused(tmp_path: Path) -> None:
    """Case 2's class: a resume compares the config with the checkpoint's. Learning rate and
    schedule changes are returned (the trainer prints them; they apply from the resumed step:
    e2e test), a changed optimizer type is refused naming the key."""
    from megatron_gspo.run.preflight import check_resume

    model = _model(tmp_path, "m")
    saved = _cfg(tmp_path, model, optim={"lr": 3e-3}).to_dict()
    _checkpoint(tmp_path, model, saved)
    cfg = _cfg(tmp_path, model, optim={"lr": 1e-5, "lr_schedule": "cosine"})
    assert check_resume(cfg) == [
        "optim.lr: 0.003 -> 1e-05",
        "optim.lr_schedule: 'constant' -> 'cosine'",
    ]
    sgd = _cfg(tmp_path, model, optim={"lr": 3e-3, "optimizer": "sgd"})
    with pytest.raises(ConfigError, match=r"optim.optimizer='sgd' on resume.*set optim.optimizer"):
        preflight(sgd, resume=True, overwrite=False, world_size=1)


# ---- 4: a checkpoint that cannot be written --------------------------------------------
def test_checkpoint_dir_that_cannot_be_written_is_refused_in_preflight(tmp_path: Path) -> None:
    """Case 4 at preflight: checkpoint.dir under a file, and (where this test may mount) on a
    read-only file system. Before: accepted; the first save failed steps later."""
    model = _model(tmp_path, "m")
    (tmp_path / "afile").write_text("")
    cfg = _cfg(tmp_path, model, checkpoint={"dir": str(tmp_path / "afile" / "ckpt")})
    with pytest.raises(ConfigError, match=r"checkpoint.dir=.*afile/ckpt: .*afile is not a dir"):
        preflight(cfg, resume=False, overwrite=False, world_size=1)
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        mount = ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)]
        if subprocess.run(mount, capture_output=True).returncode != 0:
            pytest.skip("root without mount rights: no read-only file system to test on")
    else:
        ro.chmod(0o500)
    try:
        cfg = _cfg(tmp_path, model, checkpoint={"dir": str(ro / "ckpt")})
        with pytest.raises(ConfigError, match=r"cannot write there .*(Read-only|Permission)"):
            preflight(cfg, resume=False, overwrite=False, world_size=1)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], capture_output=True)
        ro.chmod(0o700)


def test_a_failed_save_is_one_line_naming_dir_cause_and_the_kept_checkpoint(
    tmp_path: Path,
) -> None:
    """Case 4 at save time, one process: a write phase fails with ENOSPC (as torch_dist's
    writer reports it, wrapped in a CheckpointException); `agree` raises one line naming the
    directory, the cause and the intact previous checkpoint, and removes the partial one."""
    from torch.distributed.checkpoint.api import CheckpointException

    root = tmp_path / "ckpt"
    tmp = root / "step_000004.tmp"
    tmp.mkdir(parents=True)
    (root / "latest").write_text("step_000002")
    state = WriteState(root, 4, tmp)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "__0_0.distcp"))
    with state.phase():
        raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (full, None)})
    with pytest.raises(CheckpointWriteError) as got:
        state.agree()
    text = str(got.value)
    assert text.startswith(f"{root}: cannot write the checkpoint of step 4 (rank 0: [Errno 28]")
    assert "No space left on device" in text and "still names step_000002" in text, text
    assert not tmp.exists() and exit_code(got.value) == 5
    assert "\n" not in text
    assert describe(ValueError("a\nb")) == "ValueError: a"
    # what a full disk looks like between ranks: the wrapper's inner error, not the wrapper
    pos = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped = CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (pos, None)})
    assert describe(wrapped) == f"RuntimeError: {pos}"


def test_a_full_disk_is_named_when_the_writer_does_not_say_so(tmp_path: Path, monkeypatch) -> None:
    """torch's writers report a full disk as "unexpected pos 704 vs 598" (seen on a 1 MB
    tmpfs; the OSError is lost between ranks): the free space names the cause."""
    from collections import namedtuple

    from megatron_gspo.checkpoint import write as checkpoint_write

    usage = namedtuple("usage", "total used free")
    root = tmp_path / "ckpt"
    (root / "step_000002").mkdir(parents=True)
    (root / "step_000002" / "shard").write_bytes(b"x" * (3 << 20))
    (root / "latest").write_text("step_000002")
    why = "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
    monkeypatch.setattr(checkpoint_write.shutil, "disk_usage", lambda p: usage(9, 9, 1 << 20))
    assert checkpoint_write._full_disk(root, why) == (
        f"No space left on device: 1.0 MiB free, a checkpoint takes 3.0 MiB; {why}"
    )
    monkeypatch.setattr(checkpoint_write.shutil, "disk_usage", lambda p: usage(9, 0, 1 << 30))
    assert checkpoint_write._full_disk(root, why) == why


# ---- 5: an HF directory lacking a tensor ------------------------------------------------
def test_model_dir_lacking_a_tensor_is_one_line(tmp_path: Path) -> None:
    """Case 5: megatron-bridge's KeyError for a tensor its safetensors lack (its text, from
    `SafeTensorsStateSource.load_tensors` in megatron/bridge/models/hf_pretrained/state.py)
    becomes one ConfigError line (exit code 2); other KeyErrors stay what they are."""
    model = _model(tmp_path, "m")

    def build(cfg: Any) -> None:  # where Policy.build meets it: loading the HF weights
        raise KeyError(f"Keys not found in safetensors from {model}: {{'model.norm.weight'}}")

    with pytest.raises(ConfigError) as got:
        build_policy(_cfg(tmp_path, model), build)
    text = str(got.value)
    assert f"model.hf_path={model}: its weight files lack" in text and "model.norm.weight" in text
    assert exit_code(got.value) == 2

    def bug(cfg: Any) -> None:
        raise KeyError("decoder.layers.0")

    with pytest.raises(KeyError, match="decoder.layers.0"):
        build_policy(_cfg(tmp_path, model), bug)


# ---- 8: Ctrl-C while starting ---------------------------------------------------------
def _inside_torch_import(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize(
    "argv",
    [["-m", "megatron_gspo.train", "--config", "examples/tiny_moe_cpu.yaml"],
     ["tools/make_tiny_toy.py", "--out", "{tmp}/toy"]],
    ids=["train", "tool"],
)  # fmt: skip
def test_ctrl_c_while_importing_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    """Case 8: SIGINT as soon as torch's library is being loaded (the first seconds). Before:
    a KeyboardInterrupt traceback from inside the import, exit 1."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the tool finds it itself
    if argv[0] == "-m":
        env["PYTHONPATH"] = str(ROOT)
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not _inside_torch_import(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().count("\n") == 0, err[-3000:]
    assert "SIGINT: stopped while starting" in err, err


def test_config_with_new_keys_round_trips(tmp_path: Path) -> None:
    """train.max_failed_reward_steps is a documented key with a bound naming it."""
    model = _model(tmp_path, "m")
    assert _cfg(tmp_path, model).train.max_failed_reward_steps == 3
    with pytest.raises(ConfigError, match="change train.max_failed_reward_steps"):
        _cfg(tmp_path, model, train={"max_failed_reward_steps": -1})
    yaml.safe_dump(_cfg(tmp_path, model).to_dict())
