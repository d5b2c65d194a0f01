"""The start-up patch (megatron_gspo/patches/startup.py): a rank no longer imports what it
never uses, and nothing that the plain imports offered is lost.

Reference: a second process that imports megatron-bridge the plain way (our other bridge
patches only), whose list of supported architectures the lazy registry must reproduce once an
AutoBridge of a non-Qwen architecture was asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_gspo.patches import PatchError
from megatron_gspo.patches import startup as st

_NOT_NEEDED = ("megatron.bridge.models.llama", "megatron.bridge.diffusion.models")


def _tiny(config_cls: type, arch: str, **extra: int) -> object:
    return config_cls(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        architectures=[arch],
        **extra,
    )


def _lazy() -> None:  # runs in a subprocess: what a trainer rank does
    from transformers import LlamaConfig, Qwen3MoeConfig

    from megatron_gspo.patches import apply_bridge_imports

    apply_bridge_imports()
    from megatron.bridge import AutoBridge

    qwen = AutoBridge.from_hf_config(
        _tiny(Qwen3MoeConfig, "Qwen3MoeForCausalLM", num_experts=4, moe_intermediate_size=8)
    )
    seen = {"qwen": type(qwen._model_bridge).__name__}
    seen["left_out"] = [m for m in _NOT_NEEDED if m in sys.modules]
    llama = AutoBridge.from_hf_config(_tiny(LlamaConfig, "LlamaForCausalLM"))
    seen["llama"] = type(llama._model_bridge).__name__
    seen["supported"] = AutoBridge.list_supported_models()
    import megatron.bridge
    import megatron.bridge.models

    seen["names"] = sorted(set(dir(megatron.bridge)) | set(dir(megatron.bridge.models)))
    print(json.dumps(seen))


def _plain() -> None:  # runs in a subprocess: the imports as they were before the patches
    from megatron_gspo.patches import BRIDGE_PATCHES

    for patch in BRIDGE_PATCHES:
        patch.apply()
    import megatron.bridge
    import megatron.bridge.models
    from megatron.bridge import AutoBridge

    seen = {"left_out": [m for m in _NOT_NEEDED if m in sys.modules]}
    seen["supported"] = AutoBridge.list_supported_models()
    seen["names"] = sorted(set(dir(megatron.bridge)) | set(dir(megatron.bridge.models)))
    print(json.dumps(seen))


def test_self_checks_fail_when_upstream_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch's check reads the upstream source it relies on; a changed source fails it."""
    st._check_lazy_registry()
    monkeypatch.setattr(st, "_source", lambda module, rel: "")
    with pytest.raises(PatchError, match="review patch"):
        st._check_lazy_registry()


@pytest.mark.slow
def test_rank_imports_only_what_it_uses_and_loses_nothing() -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    here = "import tests.patches.test_startup_patches as t; t."
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", here + fn + "()"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for fn in ("_lazy", "_plain")
    ]
    (lazy, err), (plain, err_plain) = (p.communicate(timeout=300) for p in procs)
    assert procs[0].returncode == 0, err[-4000:]
    assert procs[1].returncode == 0, err_plain[-4000:]
    lazy, plain = json.loads(lazy.splitlines()[-1]), json.loads(plain.splitlines()[-1])
    # the plain imports load all three (what makes this test fail without the patches) ...
    assert plain["left_out"] == list(_NOT_NEEDED)
    # ... a Qwen3-MoE bridge needs none of them ...
    assert lazy["qwen"] == "Qwen3MoEBridge" and lazy["left_out"] == []
    # ... and a Llama asked for later gets its bridge: every architecture, every name as before
    assert lazy["llama"] == "LlamaBridge"
    assert lazy["supported"] == plain["supported"] and "LlamaForCausalLM" in lazy["supported"]
    assert set(plain["names"]) <= set(lazy["names"])
