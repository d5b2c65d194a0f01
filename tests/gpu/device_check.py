"""Device check for the first GPU at hand: the GPU branches the CPU suite cannot take (issue 35).

    bash tests/gpu/fetch_wheels.sh                 # on a networked machine: .whl/ (~see below)
    pip install --no-deps --no-index .whl/*.whl    # on the GPU machine (torch + Triton there)
    PYTHONPATH=. python tests/gpu/device_check.py --out device_check.json

One process, one GPU, no network, under 10 minutes on one H200 (4 sections, each timed in its
JSON). It needs torch and Triton (present on the machine; Triton builds its kernel launcher
with the machine's C compiler the first time) plus the wheels of
`tests/gpu/fetch_wheels.sh` (megatron-core, sglang without its dependencies, and the few
modules their imports need: the list and sizes are in that script). A section whose imports are
missing is reported "skip" with the ImportError, never a crash. `--device cpu --small` runs the
same code on CPU at small sizes (tests/gpu/test_device_check.py, in the quick tier).

Sections (what only a GPU can show is marked GPU):
  hash      SGLang's own `WeightChecker` answering `{"action": "checksum"}` over a module that
            holds bf16 weights the way an engine does (fused qkv_proj, stacked experts
            w13_weight / w2_weight) on the device, against the trainer's prediction from the
            HF-named tensors (`engines.weight_names.sglang_checksums` and the sender's
            `engines.weight_shards.EngineChecksums`, engine device = --device). GPU: SGLang
            takes its Triton `gpu_tensor_hash` branch; `sha256_prediction_matches` reports
            whether the pre-fix sha256 prediction would have matched (false on CUDA: issue 35
            defect 5).
  train     one bf16 training step of the tiny Qwen3-MoE shape (megatron-core GPTModel, local
            spec: no Transformer Engine on the machine; Float16Module, DDP, the package's
            `build_optimizer` with the distributed optimizer: fp32 main params), on the device.
  lm_head   the fused LM head (`algo.lm_head.fused_lm_head_logprobs`) against the unfused one
            (fp32 logits [T, V], then `algo.logprobs.vocab_parallel_logprobs`), forward and
            backward, bf16 hidden/weight, at T=8192 V=151936 H=4096 (--small: 256 x 4096 x 64):
            value differences, peak memory above the inputs (GPU: allocator peaks; CPU: null),
            seconds. GPU: the CUDA GEMM path, memory and time at the recipes' vocabulary.
  resume    save after one step with the package's `megatron.checkpoint.save_model_and_optimizer`,
            one more step; a fresh model + optimizer loads the save
            (`load_model_and_optimizer`) and takes the same step: model parameters, fp32 main
            params and Adam moments compared bitwise, after the load and after the step.

Output: ONE JSON object on stdout (and in --out), schema version 1:
  {"schema": 1, "device": "cuda"|"cpu", "device_name": str, "small": bool,
   "versions": {"torch": str, "triton": str|null, "megatron_core": str|null, "sglang": str|null},
   "ok": bool,                       # every section that ran passed
   "seconds": float,
   "sections": {
     "hash":    {"status": S, "seconds": f, "sglang": str, "engine_device": str, "tensors": int,
                 "sglang_checksums": {name: hex16}, "predicted_match": bool,
                 "sender_match": bool, "sha256_prediction_matches": bool, "mismatched": [str]},
     "train":   {"status": S, "seconds": f, "dtype": "bfloat16", "loss": float,
                 "grad_norm": float, "finite": bool, "params_changed": bool,
                 "main_params_fp32": bool, "step_seconds": float},
     "lm_head": {"status": S, "seconds": f, "T": int, "V": int, "H": int,
                 "logp_max_abs_diff": float, "entropy_max_abs_diff": float,
                 "grad_hidden_rel_diff": float, "grad_weight_rel_diff": float,
                 "fused_peak_mib": float|null, "unfused_peak_mib": float|null,
                 "fused_seconds": float, "unfused_seconds": float, "tolerance": float},
     "resume":  {"status": S, "seconds": f, "after_load_differ": [str],
                 "after_step_differ": [str], "compared": int}}}
  S is "pass", "fail" or "skip"; a "fail" or "skip" section also has "reason": str.
Exit code: 0 when ok, 1 when a section failed, 2 when nothing could run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SCHEMA = 1
SECTIONS = ("hash", "train", "lm_head", "resume")


# ---- hash ------------------------------------------------------------------------------------
def _hf_weights(dev: str, small: bool) -> dict[str, torch.Tensor]:
    """bf16 tensors under HF names: one attention block and one MoE layer (Qwen3 shapes)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    h, i, e = (64, 32, 4) if small else (2048, 768, 16)  # Qwen3-30B-A3B widths, 16 experts
    heads, kv, d = (4, 2, 16) if small else (32, 4, 128)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)

    a, x = "model.layers.0.self_attn", "model.layers.0.mlp.experts"
    w = {"model.norm.weight": r(h), f"{a}.q_proj.weight": r(heads * d, h)}
    w |= {f"{a}.k_proj.weight": r(kv * d, h), f"{a}.v_proj.weight": r(kv * d, h)}
    w |= {"model.layers.0.mlp.gate.weight": r(e, h), "model.embed_tokens.weight": r(128, h)}
    for j in range(e):
        w[f"{x}.{j}.gate_proj.weight"] = r(i, h)
        w[f"{x}.{j}.up_proj.weight"] = r(i, h)
        w[f"{x}.{j}.down_proj.weight"] = r(h, i)
    w["model.layers.0.mlp.gate.weight"][0, 0] = float("nan")  # NaN bytes hash like any others
    return w


def _engine_module(w: dict[str, torch.Tensor], e: int) -> torch.nn.Module:
    """What a one-rank SGLang engine holds of `w` (fused by hand: cat / stack)."""
    a, x = "model.layers.0.self_attn", "model.layers.0.mlp.experts"
    held = {k: v for k, v in w.items() if ".self_attn." not in k and ".experts." not in k}
    held[f"{a}.qkv_proj.weight"] = torch.cat([w[f"{a}.{p}_proj.weight"] for p in "qkv"])
    held[f"{x}.w13_weight"] = torch.stack(
        [
            torch.cat([w[f"{x}.{j}.gate_proj.weight"], w[f"{x}.{j}.up_proj.weight"]])
            for j in range(e)
        ]
    )
    held[f"{x}.w2_weight"] = torch.stack([w[f"{x}.{j}.down_proj.weight"] for j in range(e)])
    root = torch.nn.Module()
    for name, t in held.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


def _old_sha256(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """The pre-fix prediction (sha256 of the fused bytes on the host), for the report only."""
    from megatron_gspo.engines.weight_names import sglang_slot

    groups: dict[str, list[tuple[tuple[int, int], torch.Tensor]]] = {}
    for name, t in named:
        slot = sglang_slot(name)
        key, order = slot if slot else (name, (0, 0))
        groups.setdefault(key, []).append((order, t))
    out = {}
    for key, parts in groups.items():
        h = hashlib.sha256()
        for _, t in sorted(parts, key=lambda p: p[0]):
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[key] = f"{int.from_bytes(h.digest()[:8], 'big'):016x}"
    return out


#: SGLang functions taken from its source files when the sglang package does not import:
#: module -> (file under the source root, top-level names compiled from it, imports they use)
_SLICE = {
    "sglang.srt.utils.common": ("sglang/srt/utils/common.py", ("flatten_nested_list",), ""),
    "sglang.srt.managers.mm_utils": (
        "sglang/srt/managers/mm_utils.py",
        ("tensor_hash",),
        "import hashlib, torch\n"
        "from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash\n"
        "from sglang.srt.utils.common import flatten_nested_list\n",
    ),
    "sglang.srt.utils.weight_checker": (
        "sglang/srt/utils/weight_checker.py",
        ("overall_checksum", "_hash_tensor"),
        "import hashlib, torch\nfrom sglang.srt.managers.mm_utils import tensor_hash\n",
    ),
}


def _sglang_hash_functions(src: Path) -> str:
    """Make `sglang.srt.utils.weight_checker._hash_tensor` importable: the sglang package
    ("sglang <version>") if it imports, else SGLang's own functions compiled from its source
    files under `src` (tests/gpu/fetch_wheels.sh), without the package's other imports
    (transformers, ...): `sglang/kernels/ops/memory/gpu_tensor_hash.py` whole, and the named
    functions, verbatim."""
    try:
        from sglang.srt.utils import weight_checker  # noqa: F401

        return f"sglang {_version('sglang')}"
    except ImportError as e:
        if not (src / "sglang").is_dir():
            raise ImportError(f"{e}; and no SGLang source files under {src}") from e
    import ast
    import importlib.util
    import types

    def package(name: str) -> types.ModuleType:
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []
            sys.modules[name] = mod
            if "." in name:
                parent, leaf = name.rsplit(".", 1)
                setattr(package(parent), leaf, mod)
        return sys.modules[name]

    for name in [k for k in list(sys.modules) if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[name]  # a half-imported package
    name = "sglang.kernels.ops.memory.gpu_tensor_hash"
    spec = importlib.util.spec_from_file_location(
        name, src / "sglang/kernels/ops/memory/gpu_tensor_hash.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    package(name.rsplit(".", 1)[0]).gpu_tensor_hash = mod
    spec.loader.exec_module(mod)
    for modname, (path, names, imports) in _SLICE.items():
        tree = ast.parse((src / path).read_text(), str(src / path))
        body = [n for n in tree.body if getattr(n, "name", None) in names]
        if {getattr(n, "name", None) for n in body} != set(names):
            raise ImportError(f"{path}: not all of {names} found (another SGLang version?)")
        parent, leaf = modname.rsplit(".", 1)
        m = types.ModuleType(modname)
        exec(compile(imports, modname, "exec"), m.__dict__)
        exec(compile(ast.Module(body=body, type_ignores=[]), str(src / path), "exec"), m.__dict__)
        sys.modules[modname] = m
        setattr(package(parent), leaf, m)
    version = (src / "VERSION").read_text().strip() if (src / "VERSION").exists() else "?"
    return f"sglang {version} functions from {src}"


def _engine_checksums(module: torch.nn.Module, full: bool) -> dict[str, str]:
    """What the engine reports for `module`: SGLang's `WeightChecker` (full package), else its
    per-parameter `_hash_tensor` as `WeightChecker._compute_checksum` calls it for raw weights."""
    from sglang.srt.utils import weight_checker

    if not full:
        return {n: weight_checker._hash_tensor(p.data) for n, p in module.named_parameters()}
    from sglang.srt.runtime_context import get_parallel

    place = dict(tp_rank=0, tp_size=1, dp_rank=0, attn_dp_size=1, pp_rank=0, pp_size=1)
    with get_parallel().override(**place):
        checker = weight_checker.WeightChecker(get_model=lambda: module)
    return checker.handle("checksum", role="target")["checksums"]


def section_hash(dev: str, small: bool, sglang_src: Path) -> dict[str, Any]:
    source = _sglang_hash_functions(sglang_src)
    from megatron_gspo.engines.weight_names import sglang_checksums
    from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout

    w = _hf_weights(dev, small)
    e = sum(1 for n in w if n.endswith(".down_proj.weight"))
    module = _engine_module(w, e)
    reported = _engine_checksums(module, full=" functions from " not in source)
    named = list(w.items())
    predicted = sglang_checksums((n, t.cpu()) for n, t in named) if dev == "cpu" else None
    if dev != "cpu":  # the sender's tensors are on the GPU: predicted there
        from megatron_gspo.engines.weight_names import SGLangChecksums

        acc = SGLangChecksums(device="cuda")
        for n, t in named:
            acc.add(n, t)
        predicted = acc.result()
    sender = EngineChecksums([EngineLayout(1, 1, 1, 1, 1, e)], device=dev)
    sender.add_bucket(named)
    sent = sender.ranks(1)[0]
    old = _old_sha256(named)
    mismatched = sorted(n for n in reported if predicted.get(n) != reported[n])
    ok = predicted == reported and sent == reported
    return {
        "status": "pass" if ok else "fail",
        **({} if ok else {"reason": f"prediction differs from SGLang's checker: {mismatched}"}),
        "sglang": source,
        "engine_device": dev,
        "tensors": len(reported),
        "sglang_checksums": reported,
        "predicted_match": predicted == reported,
        "sender_match": sent == reported,
        "sha256_prediction_matches": old == reported,
        "mismatched": mismatched,
    }


# ---- the tiny MoE on megatron-core -----------------------------------------------------------
def _init_dist(dev: str) -> None:
    """The package's own start-up: 1-rank group (gloo on CPU, cpu:gloo,cuda:nccl on GPU),
    megatron-core's parallel state and seeds, the CPU runtime patches on CPU."""
    from megatron_gspo.dist import init_distributed
    from megatron_gspo.layout import Layout
    from megatron_gspo.megatron.model import init_megatron

    init_distributed(dev)  # type: ignore[arg-type]
    init_megatron(Layout(), seed=0)


def _tiny_moe(dev: str) -> tuple[list[torch.nn.Module], Any]:
    """The tiny Qwen3-MoE shape (megatron_gspo/data/tiny_model.py) in bf16, with the package's
    optimizer (distributed: fp32 main params)."""
    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    from megatron_gspo.config import OptimConfig
    from megatron_gspo.megatron.model import build_optimizer, ddp_config

    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # same weights for every build
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="alltoall",
        qk_layernorm=True,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=dev == "cpu",
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        moe_permute_fusion=False,
    )
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, qk_layernorm=True)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=128,
        max_sequence_length=512,
        position_embedding_type="rope",
        rotary_base=10000,
        share_embeddings_and_output_weights=False,
    )
    if dev == "cuda":
        model = model.cuda()
    model = Float16Module(cfg, model)
    wrapped = DDP(cfg, ddp_config(use_distributed_optimizer=True), model)
    optim = OptimConfig(lr=1e-3, use_distributed_optimizer=True)
    return [wrapped], build_optimizer([wrapped], optim)


def _batch(dev: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (2, 32), generator=g)
    return tokens.to(dev), torch.roll(tokens, -1, dims=1).to(dev)


def _step(model: list[torch.nn.Module], opt: Any, dev: str, seed: int) -> tuple[float, float]:
    m = model[0]
    tokens, labels = _batch(dev, seed)
    pos = torch.arange(tokens.shape[1], device=dev).unsqueeze(0).expand_as(tokens)
    m.zero_grad_buffer()
    opt.zero_grad()
    loss = m(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    m.finish_grad_sync()
    ok, grad_norm, _ = opt.step()
    if not ok:
        raise RuntimeError("the optimizer skipped the step")
    return float(loss), float(grad_norm)


def _state(model: list[torch.nn.Module], opt: Any) -> dict[str, torch.Tensor]:
    """Model parameters, fp32 main params and Adam moments, by a stable key (host copies)."""
    from megatron_gspo.patches.optimizer import chained

    out = {f"model.{n}": p.detach().cpu().clone() for n, p in model[0].named_parameters()}
    for k, o in enumerate(chained(opt)):
        for gi, group in enumerate(o.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                out[f"opt{k}.g{gi}.p{pi}.param"] = p.detach().cpu().clone()
                for sk, sv in o.optimizer.state.get(p, {}).items():
                    if torch.is_tensor(sv) and sv.numel() > 1:
                        out[f"opt{k}.g{gi}.p{pi}.{sk}"] = sv.detach().cpu().clone()
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [
        k
        for k in keys
        if k not in a or k not in b or a[k].shape != b[k].shape
        or not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8))
    ]


def section_train(dev: str, small: bool) -> dict[str, Any]:
    _init_dist(dev)
    model, opt = _tiny_moe(dev)
    before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    t0 = time.perf_counter()
    loss, grad_norm = _step(model, opt, dev, seed=1)
    if dev == "cuda":
        torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    changed = any(not torch.equal(before[n], p) for n, p in model[0].named_parameters())
    from megatron_gspo.patches.optimizer import chained

    mains = [p for o in chained(opt) for g in o.optimizer.param_groups for p in g["params"]]
    dtypes = {str(p.dtype) for p in model[0].parameters()}
    main_fp32 = bool(mains) and all(p.dtype == torch.float32 for p in mains)
    finite = all(map(lambda v: v == v and abs(v) != float("inf"), (loss, grad_norm)))
    ok = finite and changed and main_fp32 and dtypes == {"torch.bfloat16"}
    return {
        "status": "pass" if ok else "fail",
        **({} if ok else {"reason": f"finite={finite} changed={changed} fp32 main={main_fp32} "
                                    f"param dtypes={sorted(dtypes)}"}),
        "dtype": "bfloat16",
        "loss": loss,
        "grad_norm": grad_norm,
        "finite": finite,
        "params_changed": changed,
        "main_params_fp32": main_fp32,
        "step_seconds": step_s,
    }


def section_resume(dev: str, small: bool) -> dict[str, Any]:
    from megatron_gspo.megatron.checkpoint import load_model_and_optimizer, save_model_and_optimizer

    _init_dist(dev)
    model, opt = _tiny_moe(dev)
    _step(model, opt, dev, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        save_model_and_optimizer(model, opt, Path(tmp))
        saved = _state(model, opt)
        _step(model, opt, dev, seed=2)
        expected = _state(model, opt)
        model2, opt2 = _tiny_moe(dev)
        load_model_and_optimizer(model2, opt2, Path(tmp))
        after_load = _differ(saved, _state(model2, opt2))
        _step(model2, opt2, dev, seed=2)
        after_step = _differ(expected, _state(model2, opt2))
    ok = not after_load and not after_step
    return {
        "status": "pass" if ok else "fail",
        **({} if ok else {"reason": f"{len(after_load)} differ after the load, "
                                    f"{len(after_step)} after the next step"}),
        "after_load_differ": after_load[:20],
        "after_step_differ": after_step[:20],
        "compared": len(saved),
    }


# ---- lm_head ---------------------------------------------------------------------------------
def _peak(dev: str, fn: Callable[[], Any]) -> tuple[Any, float | None, float]:
    """fn's result, its peak memory above what was allocated before (MiB; None on CPU), and its
    seconds (after one warm-up call)."""
    fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if dev == "cuda":
        torch.cuda.synchronize()
        return out, (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t0
    return out, None, time.perf_counter() - t0


def section_lm_head(dev: str, small: bool) -> dict[str, Any]:
    from megatron_gspo.algo.lm_head import fused_lm_head_logprobs
    from megatron_gspo.algo.logprobs import vocab_parallel_logprobs

    t, v, h = (256, 4096, 64) if small else (8192, 151936, 4096)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(t, h, generator=g) * 2).to(torch.bfloat16).to(dev)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(torch.bfloat16).to(dev)
    target = torch.randint(0, v, (t,), generator=g).to(dev)

    def run(fused: bool) -> tuple[torch.Tensor, ...]:
        hh = hidden.detach().requires_grad_(True)
        ww = weight.detach().requires_grad_(True)
        if fused:
            logp, ent = fused_lm_head_logprobs(hh, ww, target, with_entropy=True)
        else:  # fp32 logits [T, V], as an engine with --enable-fp32-lm-head computes them
            logits = hh.float() @ ww.float().t()
            logp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True)
        (logp.sum() + 0.1 * ent.sum()).backward()
        return logp.detach(), ent.detach(), hh.grad.float(), ww.grad.float()

    fused, fpeak, fsec = _peak(dev, lambda: run(True))
    unfused, upeak, usec = _peak(dev, lambda: run(False))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    logp_d = float((fused[0] - unfused[0]).abs().max())
    ent_d = float((fused[1] - unfused[1]).abs().max())
    gh, gw = rel(fused[2], unfused[2]), rel(fused[3], unfused[3])
    # fp32 logits on both sides: log-probs agree to fp32 summation order; gradients are
    # bf16 tensors (the inputs' dtype), 2^-6 of their largest entry
    tol = 1e-3
    ok = logp_d <= tol and ent_d <= tol and gh <= 2**-6 and gw <= 2**-6
    return {
        "status": "pass" if ok else "fail",
        **({} if ok else {"reason": f"fused and unfused heads differ beyond {tol} / 2^-6"}),
        "T": t, "V": v, "H": h,
        "logp_max_abs_diff": logp_d,
        "entropy_max_abs_diff": ent_d,
        "grad_hidden_rel_diff": gh,
        "grad_weight_rel_diff": gw,
        "fused_peak_mib": fpeak,
        "unfused_peak_mib": upeak,
        "fused_seconds": fsec,
        "unfused_seconds": usec,
        "tolerance": tol,
    }  # fmt: skip


# ---- driver ----------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def run(
    dev: str, small: bool, sections: list[str], sglang_src: Path = Path(".whl/sglang-src")
) -> dict[str, Any]:
    """Every section in turn; a section's exception becomes its "fail" (or "skip" when an
    import is missing), so one JSON always comes out."""
    fns = {"hash": lambda d, s: section_hash(d, s, sglang_src), "train": section_train,
           "lm_head": section_lm_head, "resume": section_resume}  # fmt: skip
    start = time.perf_counter()
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "device": dev,
        "device_name": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "small": small,
        "versions": {
            "torch": torch.__version__,
            "triton": _version("triton"),
            "megatron_core": _version("megatron-core"),
            "sglang": _version("sglang"),
        },
        "sections": {},
    }
    for name in sections:
        t0 = time.perf_counter()
        try:
            res = fns[name](dev, small)
        except ImportError as e:
            res = {"status": "skip", "reason": f"{type(e).__name__}: {e}"}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - reported in the JSON; torch.distributed's
            # CheckpointException is a BaseException
            tb = traceback.format_exc(limit=-3).strip().splitlines()
            res = {"status": "fail", "reason": f"{type(e).__name__}: {e}", "traceback": tb}
        res["seconds"] = time.perf_counter() - t0
        out["sections"][name] = res
        print(f"[device_check] {name}: {res['status']} ({res['seconds']:.1f} s)", file=sys.stderr)
    statuses = [s["status"] for s in out["sections"].values()]
    out["ok"] = "fail" not in statuses and "pass" in statuses
    out["seconds"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="small sizes (CI on CPU)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument(
        "--sglang-src",
        default=".whl/sglang-src",
        help="SGLang source files for the hash section when the sglang package does not import "
        "(tests/gpu/fetch_wheels.sh writes them)",
    )
    # (the CPU runtime patches of megatron-core apply in --device cpu only)
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        print(f"device_check: unknown sections {bad}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: torch sees no CUDA device; run with --device cpu", file=sys.stderr)
        return 2
    result = run(args.device, args.small, sections, Path(args.sglang_src))
    text = json.dumps(result, indent=1, sort_keys=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if result["ok"]:
        return 0
    return 1 if any(s["status"] == "fail" for s in result["sections"].values()) else 2


if __name__ == "__main__":
    sys.exit(main())
