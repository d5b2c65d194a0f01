"""The embedded engine's block-FP8 emulation (engines/embedded/fp8_emulation.py).

Quantisation is compared bit for bit with an independent float64 implementation written here
(e4m3 round-to-nearest-even by explicit grid arithmetic, rounding ties included); the GEMM with
the float64 dot product of the same dequantised operands, within fp32's accumulation bound; the
engine end to end through SGLang's HTTP app against the fp32 engine's reference model; an FP8
weight push against the bytes sent.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.engines.embedded import fp8_emulation as emu
from megatron_gspo.engines.types import SamplingParams

from .helpers import hf_model, rescore

pytestmark = pytest.mark.timeout(240)

E4M3_MAX, B = 448.0, 128
U32 = 2.0**-24  # fp32 unit roundoff


# ---- independent float64 reference of the quantisation --------------------------------------
def _round_e4m3(v: float) -> float:
    """Nearest e4m3 (fn) value of a float, ties to even: grid spacing 2^(e-3) for |v| >= 2^-6
    (e = floor(log2 |v|)), 2^-9 below (subnormals); |v| <= 448 by the caller's clamp."""
    a = abs(v)
    if a == 0.0:
        return 0.0 * v
    spacing = 2.0**-9 if a < 2.0**-6 else 2.0 ** (math.floor(math.log2(a)) - 3)
    k = a / spacing  # exact: a power-of-two division
    lo = math.floor(k)
    r = lo + 1 if (k - lo > 0.5 or (k - lo == 0.5 and lo % 2 == 1)) else lo
    return math.copysign(min(r * spacing, E4M3_MAX), v)


def _f32(v: float) -> float:
    """Round a float64 to the nearest fp32 (what every fp32 operation of the kernel does)."""
    return float(torch.tensor(v, dtype=torch.float64).float())


def ref_quantise_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token groups of B: s = fp32(max(amax, 1e-10) / 448), q = e4m3(fp32(x * fp32(1/s)))."""
    m, k = x.shape
    kb = math.ceil(k / B)
    q = torch.zeros(m, k, dtype=torch.float64)
    s = torch.zeros(m, kb, dtype=torch.float64)
    for i in range(m):
        for j in range(kb):
            g = [float(v) for v in x[i, j * B : (j + 1) * B].double()]
            sc = _f32(max(max(abs(v) for v in g), 1e-10) / E4M3_MAX)
            inv = _f32(1.0 / sc)
            s[i, j] = sc
            for c, v in enumerate(g):
                q[i, j * B + c] = _round_e4m3(max(-E4M3_MAX, min(E4M3_MAX, _f32(v * inv))))
    return q, s


def ref_quantise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks: s = fp32(amax / 448), q = e4m3(fp32(w / s))."""
    n, k = w.shape
    nb, kb = math.ceil(n / B), math.ceil(k / B)
    q = torch.zeros(n, k, dtype=torch.float64)
    s = torch.zeros(nb, kb, dtype=torch.float64)
    wd = w.double()
    for bi in range(nb):
        for bj in range(kb):
            blk = wd[bi * B : (bi + 1) * B, bj * B : (bj + 1) * B]
            sc = _f32(max(float(blk.abs().max()), 1e-12) / E4M3_MAX)
            s[bi, bj] = sc
            q[bi * B : (bi + 1) * B, bj * B : (bj + 1) * B] = blk.apply_(
                lambda v, sc=sc: _round_e4m3(max(-E4M3_MAX, min(E4M3_MAX, _f32(v / sc))))
            )
    return q, s


def ref_dequantised_weight(w: torch.Tensor) -> torch.Tensor:
    """float64 `q * s` of the reference weight quantisation, every element its block's scale."""
    q, s = ref_quantise_weight(w)
    return q * s.repeat_interleave(B, 0)[: w.shape[0]].repeat_interleave(B, 1)[:, : w.shape[1]]


def ref_linear(x: torch.Tensor, dw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 `sum_k deq(x)[m,k] dw[n,k]` and `sum_k |...|` (for the error bound)."""
    qx, sx = ref_quantise_groups(x)
    dx = qx * sx.repeat_interleave(B, 1)[:, : x.shape[1]]
    return dx @ dw.T, dx.abs() @ dw.abs().T


def _with_ties(x: torch.Tensor) -> torch.Tensor:
    """Row 0, group 0 gets amax 448 (scale exactly 1) and values on e4m3 rounding midpoints:
    normal ties (1.0625 -> 1.0, 1.1875 -> 1.25, 9.5 -> 10, 2^-6 + 2^-10 -> 2^-6) and subnormal
    ones (1.5, 2.5 and 0.5 times the subnormal spacing 2^-9 -> 2, 2, 0 times it)."""
    x = x.clone()
    ties = [448.0, 1.0625, 1.1875, -1.0625, 9.5, 2.0**-9 * 1.5, 2.0**-9 * 2.5, -(2.0**-10)]
    ties += [2**-6 + 2**-10]
    x[0, : len(ties)] = torch.tensor(ties)
    # Row 1, columns 128-129: scale 7 (amax 3136), whose reciprocal is inexact: 10.9375 / 7 is
    # the tie 1.5625 (-> 1.5: weights, divided by their scale), but SGLang's activation kernel
    # multiplies by fp32(1/7), and fp32(10.9375 * fp32(1/7)) = 1.5625001 -> 1.625.
    x[1, 128:130] = torch.tensor([3136.0, 10.9375])
    return x


def _mixed(shape: tuple[int, int], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over 5 decades, so groups hit e4m3 subnormals relative to their scale.
    return (
        torch.randn(shape, generator=g)
        * torch.logspace(-4, 1, shape[1])[torch.randperm(shape[1], generator=g)]
    )


def test_activation_quantisation_is_bitwise_the_reference() -> None:
    x = _with_ties(_mixed((6, 300), seed=0))  # 3 groups, the last one partial (44 columns)
    x[3, 128:256] = 0.0  # an all-zero group: scale 1e-10 / 448, q = 0
    q, s = emu.quantise_activation(x)
    q_ref, s_ref = ref_quantise_groups(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(q.double(), q_ref) and torch.equal(s.double(), s_ref)
    assert q[0, :5].tolist() == [448.0, 1.0, 1.25, -1.0, 10.0]  # ties went to even
    assert q[1, 129].item() == 1.625  # x * (1/s), not x / s


def test_weight_quantisation_is_bitwise_the_reference() -> None:
    """A decoder linear (chosen by its HF name) is swapped for block FP8, and a pushed fp32
    weight is held as `fp8.quantise_blockwise` makes it, which equals the float64 reference
    (ties included); 200 x 300 spans partial blocks on both axes. lm_head stays a Linear."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    root.model.layers[0].self_attn = torch.nn.Module()
    root.model.layers[0].self_attn.q_proj = torch.nn.Linear(300, 200, bias=False)
    root.lm_head = torch.nn.Linear(300, 200, bias=False)
    held = emu.emulate(root, "fp8")
    assert isinstance(root.lm_head, torch.nn.Linear)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert set(held.held) == {name}
    w = _with_ties(_mixed((200, 300), seed=1))
    assert held.load(name, w)
    q_ref, s_ref = ref_quantise_weight(w)
    lin = root.model.layers[0].self_attn.q_proj
    assert torch.equal(lin.weight.double(), q_ref)
    assert torch.equal(lin.weight_scale_inv.double(), s_ref)
    assert lin.weight[0, :5].tolist() == [448.0, 1.0, 1.25, -1.0, 10.0]  # ties went to even
    assert lin.weight[1, 129].item() == 1.5  # w / s: the tie, to even


def test_linear_matches_float64_reference() -> None:
    x = _with_ties(_mixed((5, 300), seed=2))
    w = _mixed((200, 300), seed=3)
    lin = torch.nn.Linear(300, 200, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    y = emu.BlockFp8Linear(lin)(x).double()
    dw = ref_dequantised_weight(w)
    y_ref, mag = ref_linear(x, dw)
    # fp32 error of the emulated order: <= 128 - 1 adds inside a block, 2 scale products, and
    # Kb - 1 adds across blocks, each at most U32 relative of the running magnitude.
    bound = (B + 3 + 2) * U32 * mag
    assert ((y - y_ref).abs() <= bound).all()
    # The bound is tight enough to see a missing quantisation step.
    w_deq = ref_quantise_weight(w)
    no_act_quant = (
        x.double()
        @ (w_deq[0] * w_deq[1].repeat_interleave(B, 0)[:200].repeat_interleave(B, 1)[:, :300]).T
    )
    assert ((no_act_quant - y_ref).abs() > bound).any()
    assert ((x.double() @ w.double().T - y_ref).abs() > bound).any()


def test_experts_match_float64_reference() -> None:
    """Each expert's gate/up/down quantised on its own (per-expert blocks), routed as
    transformers' fused experts: against per-expert float64 linears."""
    e, inter, hidden = 3, 32, 64

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(
                _mixed((e * 2 * inter, hidden), 4).view(e, 2 * inter, hidden)
            )
            self.down_proj = torch.nn.Parameter(
                _mixed((e * hidden, inter), 5).view(e, hidden, inter)
            )
            self.act_fn = torch.nn.SiLU()

    fused = Fused()
    mod = emu.BlockFp8Experts(fused)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(7, hidden, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(7)])
    wts = torch.rand(7, 2, generator=g)
    out = mod(h, idx, wts).double()
    ref = torch.zeros(7, hidden, dtype=torch.float64)
    gu, dn = fused.gate_up_proj.detach(), fused.down_proj.detach()
    dws = [
        [ref_dequantised_weight(w) for w in (gu[ex, :inter], gu[ex, inter:], dn[ex])]
        for ex in range(e)
    ]
    for t in range(7):
        for slot in range(2):
            ex = int(idx[t, slot])
            gate, _ = ref_linear(h[t : t + 1], dws[ex][0])
            up, _ = ref_linear(h[t : t + 1], dws[ex][1])
            act = (torch.nn.functional.silu(gate) * up).float()
            down, _ = ref_linear(act, dws[ex][2])
            ref[t] += down[0] * float(wts[t, slot])
    # Only fp32 rounding separates them (the intermediate re-quantisation sees fp32 inputs in
    # both; an e4m3 rounding flip there would be ~2^-4 relative, far above this tolerance).
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# ---- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_fp8(ckpt_a):
    from megatron_gspo.engines.embedded.server import EmbeddedServer

    srv = EmbeddedServer(ckpt_a, quantization="fp8").start()
    yield srv
    srv.stop()


@pytest.fixture
def client_fp8(engine_fp8):
    from megatron_gspo.engines.client import ClientConfig, SGLangClient

    c = SGLangClient(ClientConfig(engine_urls=[engine_fp8.url], validate_requests=True))
    yield c
    c.close()


PROMPTS = [[1, 17, 33, 9], [1, 5], [1, 99, 98, 97, 96, 3]]


@pytest.mark.slow  # an in-process engine of its own
def test_fp8_engine_generates_with_real_mismatch(client_fp8, ckpt_a):
    """Through SGLang's HTTP app: generation works and every log-prob differs from the fp32
    model's (the fp32 embedded engine matches it to 2e-5, test_embedded.py) by an FP8-sized
    amount: far above fp32 noise, far below a broken model."""
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, ignore_eos=True)
    res = client_fp8.generate(PROMPTS, sp, n=2)
    ref = hf_model(ckpt_a)
    diffs = []
    for s in res.samples:
        assert len(s.response_ids) == len(s.logprobs) == 16
        trainer = rescore(ref, s.prompt_ids, s.response_ids)
        diffs += [abs(a - b) for a, b in zip(s.logprobs, trainer)]
    d = torch.tensor(diffs)
    assert 1e-3 < float(d.mean()) < 0.2, float(d.mean())
    assert float(d.max()) < 1.0


@pytest.mark.slow  # an in-process engine of its own
def test_fp8_push_is_held_bitwise(client_fp8, engine_fp8, ckpt_b, weights_a, weights_b, tmp_path):
    """A push in FP8 form (our sync's own conversion and bucketing) is held bit for bit,
    verified the way WeightSync verifies; a BF16 push of the same weights is quantised by
    `fp8.quantise_blockwise`."""
    from safetensors.torch import load_file

    from megatron_gspo.engines.embedded.model import HFPolicy
    from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout
    from megatron_gspo.weights import fp8
    from megatron_gspo.weights.fp8_checkpoint import write_fp8_checkpoint
    from megatron_gspo.weights.stream import iter_buckets
    from megatron_gspo.weights.verify import verify_engines

    def push(named, version: str, **kw) -> tuple[dict[str, torch.Tensor], EngineChecksums]:
        sent: dict[str, torch.Tensor] = {}
        sums = EngineChecksums([EngineLayout(1, 1, 1, 1, 1)])
        with client_fp8.weight_update_session(weight_version=version):
            for b in iter_buckets(iter(named), bucket_bytes=1 << 14, **kw):
                client_fp8.update_weights_from_tensor(b.tensors)
                for name, t in b.tensors:  # checksummed as sent, as WeightSync.push does
                    sums.add(name, t)
                sent.update(b.tensors)
        return sent, sums

    before = client_fp8.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
    named = sorted(weights_b.items())
    sent, sums = push(named, "fp8-1", dtype=torch.float32, use_fp8=True, fp8_check=True)
    assert sum(t.dtype == torch.float8_e4m3fn for t in sent.values()) == 2 * 4 + 2 * 4 * 3
    verify_engines([client_fp8], sums)  # raises WeightIntegrityError on any byte
    held = dict(engine_fp8.policy.checkpoint_tensors())
    assert set(held) == set(sent)
    for name, t in sent.items():
        assert held[name].dtype == t.dtype
        assert torch.equal(held[name].view(torch.uint8), t.view(torch.uint8)), name
    after = client_fp8.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert after.samples[0].logprobs != before.samples[0].logprobs
    # It now computes exactly what an FP8 engine started from checkpoint b computes (nothing
    # of the old weights survives in any cached GEMM operand).
    fresh = HFPolicy(ckpt_b, quantization="fp8")
    ids = torch.tensor([sum(PROMPTS, [])])
    with torch.no_grad(), engine_fp8.policy.lock:
        assert torch.equal(engine_fp8.policy.model(ids).logits, fresh.model(ids).logits)
    # ... and what one started from checkpoint b written as a block-FP8 checkpoint computes.
    fp8_dir = write_fp8_checkpoint(ckpt_b, tmp_path / "fp8_b")
    from_fp8 = HFPolicy(fp8_dir, quantization="fp8")
    assert torch.equal(from_fp8.model(ids).logits, fresh.model(ids).logits)
    on_disk = load_file(str(fp8_dir / "model.safetensors"))
    held = dict(from_fp8.checkpoint_tensors())
    assert set(held) == set(on_disk)
    assert all(
        torch.equal(held[n].view(torch.uint8), t.view(torch.uint8)) for n, t in on_disk.items()
    )

    # BF16 tensors of quantised weights: the engine quantises them as our FP8 sync would.
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in sorted(weights_a.items())]
    push(bf16, "default")
    held = dict(engine_fp8.policy.checkpoint_tensors())
    for name, t in bf16:
        if fp8.is_quantised_name(name, t):
            q, s = fp8.quantise_blockwise(t)
            assert torch.equal(held[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(held[fp8.scale_name(name)], s), name
        else:
            assert torch.equal(held[name], t.float()), name
    engine_fp8.policy.load_weights(weights_a.items())  # back to checkpoint a


def test_quantization_flag_reaches_the_embedded_engine() -> None:
    from megatron_gspo.engines.embedded.cli import parser
    from megatron_gspo.engines.launch import LaunchConfig, engine_command

    cmd = engine_command(LaunchConfig(model_path="m", backend="embedded", quantization="fp8"), 0)
    assert parser().parse_args(cmd[3:]).quantization == "fp8"
    assert "--quantization" not in engine_command(LaunchConfig(model_path="m"), 0)
    with pytest.raises(ValueError, match="rollout.launch.quantization='int8'"):
        LaunchConfig(backend="embedded", quantization="int8")


def test_planner_accepts_a_bf16_checkpoint_for_the_embedded_fp8_engine(ckpt_a) -> None:
    """The embedded engine quantises a BF16 checkpoint on load; a real server cannot (it needs
    the block-FP8 checkpoint's weight_scale_inv parameters), which the planner still refuses."""
    from megatron_gspo.config import load_config
    from megatron_gspo.plan.topology import fp8_problems

    base = [f"model.hf_path={ckpt_a}", "data.train_path=/d.jsonl", "weights.fp8=true"]
    embedded = load_config(None, [*base, "rollout.launch.quantization=fp8"])
    assert fp8_problems(embedded, ckpt_a) == []
    sglang = load_config(None, [*base, "rollout.launch.backend=sglang"])
    assert "not a block-FP8 checkpoint" in fp8_problems(sglang, ckpt_a)[0]
