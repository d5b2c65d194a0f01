"""The FP8 block quantisation config we write for the engine, read back with SGLang's own code.

FP8 sync sends e4m3 weights + `weight_scale_inv` for decoder linear weights and BF16 for the
rest (`fp8.is_quantised_name`). An engine holds matching parameters only if its config.json's
`quantization_config` makes SGLang build exactly those modules as FP8: these tests parse our
config with SGLang 0.5.23's `Fp8Config.from_config` and ask its `is_layer_skipped`, for every
linear module of the tiny Qwen3-MoE in SGLang's own (fused) naming, whether it is quantised.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.weights import load_hf_state
from megatron_gspo.weights import fp8, hf_io


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("fp8cfg") / "hf", seed=0)


def _sglang_fp8(qcfg: dict):
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    cfg = Fp8Config.from_config(qcfg)
    return cfg, lambda prefix: is_layer_skipped(
        prefix, cfg.ignored_layers, fused_mapping=cfg.packed_modules_mapping
    )


def _sglang_linear_modules(config: dict) -> dict[str, list[str]]:
    """SGLang Qwen3-MoE linear module prefix -> the HF weights it is loaded from."""
    out: dict[str, list[str]] = {"lm_head": ["lm_head.weight"]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.self_attn.qkv_proj"] = [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]
        out[f"{p}.self_attn.o_proj"] = [f"{p}.self_attn.o_proj.weight"]
        out[f"{p}.mlp.gate"] = [f"{p}.mlp.gate.weight"]
        out[f"{p}.mlp.experts"] = [
            f"{p}.mlp.experts.{e}.{w}_proj.weight"
            for e in range(config["num_local_experts"])
            for w in ("gate", "up", "down")
        ]
    return out


def _disagreements(qcfg: dict, config: dict, state: dict[str, torch.Tensor]) -> list[str]:
    """Modules SGLang would quantise differently from what FP8 sync sends."""
    _, skipped = _sglang_fp8(qcfg)
    bad = []
    for module, hf_names in _sglang_linear_modules(config).items():
        if hf_names[0] not in state:
            continue  # e.g. lm_head tied to the embeddings
        sent_fp8 = {fp8.is_quantised_name(n, state[n]) for n in hf_names}
        assert len(sent_fp8) == 1, f"{module}: sync mixes FP8 and BF16 shards"
        if skipped(module) == sent_fp8.pop():
            bad.append(module)
    return bad


def test_sglang_quantises_exactly_what_fp8_sync_sends(hf_dir: Path) -> None:
    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    qcfg = fp8.quantization_config_for(config)
    cfg, _ = _sglang_fp8(qcfg)
    assert cfg.is_checkpoint_fp8_serialized and cfg.weight_block_size == [128, 128]
    assert cfg.activation_scheme == "dynamic" and qcfg["fmt"] == "e4m3"
    assert _disagreements(qcfg, config, state) == []
    # The check can fail: without the modules we keep BF16, SGLang would build the routers
    # and lm_head as FP8 and expect a `weight_scale_inv` that sync never sends.
    bare = _disagreements(fp8.quantisation_config(), config, state)
    assert bare == ["lm_head"] + [f"model.layers.{i}.mlp.gate" for i in range(2)]


def test_config_from_a_pretrained_config_equals_the_dict_one(hf_dir: Path) -> None:
    from transformers import AutoConfig

    config = json.loads((hf_dir / "config.json").read_text())
    assert fp8.quantization_config_for(AutoConfig.from_pretrained(hf_dir)) == (
        fp8.quantization_config_for(config)
    )
    dense = {"num_hidden_layers": 3}  # no experts: no routers to keep
    assert fp8.quantization_config_for(dense)["modules_to_not_convert"] == ["lm_head"]


def test_write_fp8_checkpoint(hf_dir: Path, tmp_path: Path) -> None:
    out = hf_io.write_fp8_checkpoint(hf_dir, tmp_path / "fp8")
    config = json.loads((out / "config.json").read_text())
    qcfg = config["quantization_config"]
    keys = ("quant_method", "fmt", "weight_block_size", "activation_scheme")
    assert {k: qcfg[k] for k in keys} == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    assert qcfg == fp8.quantization_config_for(json.loads((hf_dir / "config.json").read_text()))
    src = load_file(str(hf_dir / "model.safetensors"))
    got = load_hf_state(out)
    n_fp8 = 0
    for name, t in src.items():
        if fp8.is_quantised_name(name, t):
            n_fp8 += 1
            q, s = got[name], got[fp8.scale_name(name)]
            assert q.dtype == torch.float8_e4m3fn and s.shape == fp8.scale_shape(t.shape)
            fp8.check_dequantised(name, t, q, s)  # raises outside e4m3's bound
        else:
            assert got[name].dtype == torch.bfloat16
            assert torch.equal(got[name], t.to(torch.bfloat16))
    assert n_fp8 > 0 and len(got) == len(src) + n_fp8
    assert (out / "tokenizer.json").exists() == (hf_dir / "tokenizer.json").exists()
