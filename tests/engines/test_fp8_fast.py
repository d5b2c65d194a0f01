"""The FP8 emulation's fast path (engines/embedded/fp8_fast.py) computes bit for bit what its
reference path (fp8_emulation.py: `quantise_activation`, `block_fp8_matmul`, `fp8_linear`,
`BlockFp8Experts.reference_forward`, itself checked against float64 in test_fp8_emulation.py)
computes: per kernel on inputs with e4m3 rounding ties and partial blocks, and for whole
generations of the engine's policy (sampled tokens and log-probs, `torch.equal`).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.embedded import fp8_emulation as emu
from megatron_gspo.engines.embedded import fp8_fast

from .test_fp8_emulation import _mixed, _with_ties

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("k", [64, 128, 300])  # one short group, one full, 3 with a partial
def test_quantise_and_gemm_are_the_reference_bitwise(k: int) -> None:
    x = _mixed((6, k), seed=10 + k)
    if k == 300:
        x = _with_ties(x)
        x[3, 128:256] = 0.0  # an all-zero group
    q_ref, s_ref = emu.quantise_activation(x)
    a, s = fp8_fast.quantise(x)
    assert torch.equal(a, q_ref.float()) and torch.equal(s, s_ref)

    q_w, s_w = emu.fp8_lib.quantise_blockwise(_mixed((200, k), seed=20 + k))
    w, s_rows = emu.prepare_weight(q_w, s_w)
    y_ref = emu.block_fp8_matmul(q_ref, s_ref, w, s_rows)
    assert torch.equal(fp8_fast.gemm(a, s, fp8_fast.prepare(q_w, s_w)), y_ref)


def test_activation_cache_refills_on_a_new_or_changed_input() -> None:
    """q/k/v read one tensor and share its quantisation; an in-place change (a new version)
    or another tensor is quantised afresh."""
    lin = torch.nn.Linear(64, 32, bias=False)
    fast = emu.BlockFp8Linear(lin)
    x = _mixed((3, 64), seed=30)
    outs = []
    for step in range(3):
        if step == 1:
            x.mul_(3.0)  # same object, new version
        if step == 2:
            x = x.clone().add_(1.0)  # another tensor
        y = fast(x)
        fast._cache.reference = True
        outs.append((y, fast(x)))
        fast._cache.reference = False
    for y, y_ref in outs:
        assert torch.equal(y, y_ref)
    assert not torch.equal(outs[0][0], outs[1][0])


def _generations(policy, reference: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Tokens and log-probs of 4 sampled sequences (prompts of 2 and 6 tokens, 10 new tokens)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    policy.fp8.cache.reference = reference
    prompts = [[1, 5], [1, 99, 98, 97, 96, 3]]
    ids, lps = [], []
    for i, p in enumerate(prompts):
        for j in range(2):
            sp = SamplingParams(max_new_tokens=10, temperature=1.0, ignore_eos=True,
                                sampling_seed=100 * i + j)  # fmt: skip
            sp.normalize(None)
            out = policy.generate(p, sp)
            ids.append(torch.tensor(out.output_ids))
            lps.append(torch.tensor(out.logprobs, dtype=torch.float64))
    return ids, lps


@pytest.mark.parametrize(
    "overrides",
    [
        # ~16 s at load 4: the quick tier keeps the kernels' bitwise checks above
        pytest.param({}, marks=pytest.mark.slow),
        pytest.param({"hidden_size": 200, "moe_intermediate_size": 160}, marks=pytest.mark.slow),
    ],
    ids=["tiny", "two-K-blocks"],
)
def test_fast_generation_is_the_reference_bitwise(tmp_path, overrides) -> None:
    """The embedded policy (prefill with several tokens, decode one at a time, top-2 experts)
    samples the same tokens with the same log-probs on both paths, for the study's model and
    one whose hidden and expert sizes span two K blocks; a pushed weight reaches both."""
    from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
    from megatron_gspo.engines.embedded.model import HFPolicy

    policy = HFPolicy(save_tiny_hf_checkpoint(tmp_path / "m", seed=0, **overrides),
                      quantization="fp8")  # fmt: skip
    assert policy.fp8 is not None
    first = None
    for version in range(2):
        fast = _generations(policy, reference=False)
        ref = _generations(policy, reference=True)
        assert all(torch.equal(a, b) for a, b in zip(fast[0], ref[0]))
        assert all(
            torch.equal(a.view(torch.int64), b.view(torch.int64)) for a, b in zip(fast[1], ref[1])
        )
        if version == 0:  # a new weight version: cached GEMM operands must not survive it
            first = fast
            name = "model.layers.0.mlp.experts.1.up_proj.weight"
            w = policy.fp8.target(name)
            assert w is not None
            policy.load_weights([(name, w.float().flip(0) * 2)])
    assert first is not None and not all(torch.equal(a, b) for a, b in zip(fast[1], first[1]))
