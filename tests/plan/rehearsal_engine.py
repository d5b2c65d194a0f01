"""A CPU stand-in for one `sglang.launch_server` of any TP / EP size, for recipe rehearsals.

    python -m tests.plan.rehearsal_engine <the sglang.launch_server flags the planner emits>

SGLang's own HTTP app and the embedded engine's control plane (sessions, versions, transports)
serve it; generation runs the HF model on CPU. What it adds is what a real multi-GPU server
would enforce and report:

* parameters as SGLang builds them from `--model-path`: a block-FP8 checkpoint (its
  config.json has a fp8 `quantization_config` with `weight_block_size`) gives each quantised
  linear an e4m3 `weight` and an fp32 `weight_scale_inv`; any other start (BF16, or BF16 with
  `--quantization fp8`, which SGLang quantises online without scale parameters) has no
  `weight_scale_inv`. A pushed name the engine has no parameter for fails the load, as SGLang's
  `params_dict[name]` does; a BF16 tensor pushed into an FP8 parameter is cast into it (the
  scale stays what it was), as `param.copy_` does;
* `/weights_checker`: one entry per TP rank over that rank's shard (`engines/weight_shards.py`'s
  sharding, itself checked against materialised shards in tests/engines/test_weight_shards.py),
  FP8 parameters hashed dequantised, as SGLang's `Fp8BlockComparable`.

GPU-only flags (--base-gpu-id, --mem-fraction-static, --enable-memory-saver, ...) are accepted
and ignored.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from megatron_gspo.engines.embedded import server as embedded
from megatron_gspo.engines.embedded.model import HFPolicy
from megatron_gspo.engines.embedded.tokenizer_manager import EmbeddedTokenizerManager
from megatron_gspo.engines.weight_names import SGLangChecksums
from megatron_gspo.engines.weight_shards import EngineLayout, engine_shard
from megatron_gspo.engines.wire import overall_checksum
from megatron_gspo.weights import fp8


def _is_block_fp8(config: dict) -> bool:
    q = config.get("quantization_config") or {}
    return q.get("quant_method") == "fp8" and bool(q.get("weight_block_size"))


class ShardedPolicy(HFPolicy):
    """HFPolicy (generation on the dequantised weights) + the parameters SGLang would hold."""

    def __init__(self, model_path: str, *, dtype: torch.dtype, tp: int, ep: int) -> None:
        from safetensors.torch import load_file, save_file

        config = json.loads((Path(model_path) / "config.json").read_text())
        held: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            held.update(load_file(str(f)))
        self.block_fp8 = _is_block_fp8(config)
        self.engine_dtype = dtype
        self.held = {n: (t if self._is_fp8_param(n) else t.to(dtype)) for n, t in held.items()}
        self.layout = EngineLayout.of(config, tp, ep)
        gen_dir = model_path
        if self.block_fp8:  # transformers cannot run block FP8 on CPU: generate from bf16
            self._tmp = tempfile.TemporaryDirectory(prefix="rehearsal_engine_")
            gen_dir = self._tmp.name
            plain = {k: v for k, v in config.items() if k != "quantization_config"}
            (Path(gen_dir) / "config.json").write_text(json.dumps(plain))
            save_file(dict(self._dequantised()), f"{gen_dir}/model.safetensors")
        super().__init__(gen_dir, dtype=torch.float32)
        self.model_path = model_path

    def _is_fp8_param(self, name: str) -> bool:
        return self.block_fp8 and (name.endswith(fp8.SCALE_SUFFIX) or fp8.is_quantised_name(name))

    def _dequantised(self):
        """(HF name, bf16/engine-dtype tensor) of every parameter, FP8 ones dequantised."""
        for name, t in self.held.items():
            if name.endswith(fp8.SCALE_SUFFIX):
                continue
            s = self.held.get(fp8.scale_name(name))
            if t.dtype == torch.float8_e4m3fn and s is not None:
                yield name, fp8.dequantise_blockwise(t, s).to(torch.bfloat16)
            else:
                yield name, t

    def load_weights(self, named_tensors) -> int:
        n, touched = 0, set()
        with self.lock:
            for name, t in named_tensors:
                if name not in self.held:
                    raise KeyError(f"no parameter {name!r} in this engine (SGLang params_dict)")
                p = self.held[name]
                if tuple(p.shape) != tuple(t.shape):
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != {tuple(p.shape)}")
                self.held[name] = t.to(p.dtype).clone()
                touched.add(name.removesuffix(fp8.SCALE_SUFFIX))
                n += 1
            new = [(k, v) for k, v in self._dequantised() if k in touched]
            super().load_weights(new)
        return n

    def load_from_disk(self, path) -> int:
        from safetensors.torch import load_file

        n = 0
        for f in sorted(Path(path).glob("*.safetensors")):
            n += self.load_weights(load_file(str(f)).items())
        return n

    def rank_checksums(self) -> list[dict[str, Any]]:
        """SGLang's /weights_checker entries, one per TP rank."""
        with self.lock:
            accs = [SGLangChecksums() for _ in range(self.layout.tp_size)]
            for name, t in self._dequantised():
                for r, acc in enumerate(accs):
                    part = engine_shard(name, t, r, self.layout)
                    if part is not None:
                        acc.add(*part)
        out = []
        for r, acc in enumerate(accs):
            sums = acc.result()
            tp = self.layout.tp_size
            info = dict(role="target", tp_rank=r, tp_size=tp, dp_rank=0, dp_size=1, pp_rank=0,
                        pp_size=1, rank=r, size=tp)  # fmt: skip
            out.append(
                {
                    "checksums": sums,
                    "per_gpu_checksum": overall_checksum(sums),
                    "parallelism_info": info,
                }  # fmt: skip
            )
        return out


def join_gloo_rank(
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=30),
) -> Any:
    """One rank of a weight-update group joined as SGLang's `init_custom_process_group` does
    (the same store keys), as a bare gloo backend not registered under `group_name`.

    SGLang's TP workers are processes of their own, each registering the group under its
    name; here TP ranks are threads of one process, where a name registers once, and the
    store keys `_new_process_group_helper` uses derive from that name (a second name would
    never meet the trainer). Use `pg.broadcast(tensor, root).wait()` on it.
    """
    from torch.distributed.distributed_c10d import PrefixStore, ProcessGroupGloo, rendezvous

    init = f"tcp://{master_address}:{master_port}"
    store, _, _ = next(rendezvous(init, rank, world_size, timeout=timeout))
    # init_custom_process_group's prefix, then _new_process_group_helper's and its device's
    store = PrefixStore("cpu/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    return ProcessGroupGloo(store, rank, world_size, timeout=timeout)


class RehearsalTokenizerManager(EmbeddedTokenizerManager):
    """The embedded control plane; the weight-update group is joined by every TP rank (one
    thread and gloo group each, at ranks rank_offset + r, as SGLang's TP workers join it), and
    each broadcast is received by all of them."""

    def __init__(self, policy: ShardedPolicy, server_args: Any, **kw: Any) -> None:
        super().__init__(policy, server_args, **kw)
        self._extra: dict[str, list[Any]] = {}

    async def init_weights_update_group(self, obj: Any, request: Any = None):
        import asyncio

        tp = self.policy.layout.tp_size

        def join(r: int) -> Any:
            if r:  # TP ranks 1..: see join_gloo_rank
                return join_gloo_rank(
                    obj.master_address, obj.master_port, obj.world_size, obj.rank_offset + r,
                    obj.group_name,
                )  # fmt: skip
            return self._join_group(obj)

        try:
            groups = await asyncio.gather(*(asyncio.to_thread(join, r) for r in range(tp)))
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."
        self._groups[obj.group_name] = groups[0]
        self._extra[obj.group_name] = list(groups[1:])
        return True, "Succeeded to initialize custom process group."

    async def destroy_weights_update_group(self, obj: Any, request: Any = None):
        self._extra.pop(obj.group_name, None)  # unregistered backends: dropped with the ref
        return await super().destroy_weights_update_group(obj, request)

    async def update_weights_from_distributed(self, obj: Any, request: Any = None):
        import asyncio

        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        dtypes = [getattr(torch, d) for d in obj.dtypes]

        def receive(pg: Any) -> None:  # what TP ranks 1.. receive (rank 0 loads for all)
            if obj.load_format == "flattened_bucket":
                b = FlattenedTensorBucket.empty(obj.names, dtypes, obj.shapes, "cpu")
                pg.broadcast(b.get_flattened_tensor(), 0).wait()
            else:
                for dtype, shape in zip(dtypes, obj.shapes, strict=True):
                    pg.broadcast(torch.empty(shape, dtype=dtype), 0).wait()

        extra = self._extra.get(obj.group_name, []) if self._session_open else []
        others = [asyncio.create_task(asyncio.to_thread(receive, pg)) for pg in extra]
        out = await super().update_weights_from_distributed(obj, request)
        await asyncio.gather(*others)
        return out

    async def check_weights(self, obj: Any, request: Any = None):
        import asyncio
        import hashlib

        ranks = await asyncio.to_thread(self.policy.rank_checksums)
        total = hashlib.sha256("".join(r["per_gpu_checksum"] for r in ranks).encode())
        return True, "Success", ranks, total.hexdigest()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None)
    p.add_argument("--weight-version", default="default")
    args, _gpu_only = p.parse_known_args(argv)
    torch.set_num_threads(1)
    torch.multiprocessing.set_sharing_strategy("file_system")
    logging.basicConfig(level=logging.WARNING)
    dtype = getattr(torch, args.dtype)
    policy = ShardedPolicy(args.model_path, dtype=dtype, tp=args.tp_size, ep=args.ep_size)
    app = embedded._install_sglang_app(args.model_path)
    tm = RehearsalTokenizerManager(
        policy, embedded._INSTALLED["server_args"], weight_version=args.weight_version
    )

    async def asgi(scope, receive, send):
        token = embedded._CURRENT_TM.set(tm)
        try:
            await app(scope, receive, send)
        finally:
            embedded._CURRENT_TM.reset(token)

    import uvicorn

    print(f"rehearsal_engine tp={args.tp_size} ep={args.ep_size} on {args.port}", flush=True)
    uvicorn.run(asgi, host=args.host, port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
