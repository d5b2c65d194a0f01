"""benchmarks/mismatch_sources.py's two real-server variants launch the servers they name.

Since real SGLang engines compute fp32 logits by default (`LaunchConfig.fp32_lm_head`), the
benchmark's "bf16" server (SGLang's bf16 logits) must turn it off: it once did not, and both of
its columns measured fp32 logits (same per-token mismatch, 1.9e-3, at step 60)."""

from __future__ import annotations

from benchmarks.mismatch_sources import sglang_variant
from megatron_gspo.engines.launch import engine_command


def test_bf16_variant_has_bf16_logits_and_h32_has_fp32_logits() -> None:
    commands = {
        name: engine_command(sglang_variant(name, "/m", "python3", 30000, None), 0)
        for name in ("bf16", "bf16-h32")
    }
    assert "--enable-fp32-lm-head" not in commands["bf16"]
    assert "--enable-fp32-lm-head" in commands["bf16-h32"]
    for cmd in commands.values():
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
