"""A weight-receiving stand-in for one SGLang server of TP size N, in N processes, on CPU.

    python -m tests.weights.tp_engine --model-path DIR --host H --port P --tp-size N

SGLang's own HTTP app parses every request (as in the embedded engine); behind it a tokenizer
manager fans each weight call out to N TP "rank" processes (forked from this one), and each rank
runs SGLang 0.5.23's own scheduler-side code for it:

* tensor: `TpModelWorker.deserialize_own_rank` (rank r decodes entry r of
  `serialized_named_tensors`: too few entries fail), then `WeightUpdater.update_weights_from_tensor`
  with `load_format="flattened_bucket"`;
* distributed: `WeightUpdater.init_weights_update_group` (group rank = `rank_offset + tp_rank`),
  `_receive_bucketed_weights_from_distributed` (broadcast into a `FlattenedTensorBucket`) and
  `load_weights_from_distributed`.

The "model" of each rank records what `load_weights` received; `/weights_checker` reports, per
rank, the checksum of every tensor it holds and its rank/size in the weight-update group.
Gloo picks its device from `GLOO_SOCKET_IFNAME` (set it on hosts whose name resolves to
loopback, as in the two-host test).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import threading
import types
from datetime import timedelta
from typing import Any

import torch

from megatron_gspo.engines.embedded.server import _CURRENT_TM, _INSTALLED, _install_sglang_app
from megatron_gspo.engines.embedded.tokenizer_manager import EmbeddedTokenizerManager
from megatron_gspo.engines.wire import tensor_checksum


class _Recorder(torch.nn.Module):
    """The rank's model: keeps a copy of every tensor `load_weights` is given."""

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[str, torch.Tensor] = {}

    def load_weights(self, named: Any) -> None:
        for name, t in named:
            self.held[name] = t.detach().clone()


def _rank_main(conn: Any, tp_rank: int, join_timeout_s: float) -> None:
    """One TP rank: run SGLang's weight-update code for each request from the frontend."""
    import torch.distributed as dist
    from sglang.srt.managers import tp_worker
    from sglang.srt.model_executor.model_runner_components import weight_updater as wu_mod

    torch.set_num_threads(1)
    # SGLang asserts a default group before building the weight-update group (its TP group);
    # a one-rank stand-in, so that only the weight-update group spans processes.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # `deserialize_own_rank` reads the TP rank from SGLang's parallel context.
    tp_worker.get_parallel = lambda: types.SimpleNamespace(tp_rank=tp_rank)
    model = _Recorder()
    updater = wu_mod.WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda **_: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )
    # SGLang's timeout for this group is its default (30 min); a test needs a bound.
    real_init = wu_mod.init_custom_process_group
    wu_mod.init_custom_process_group = lambda **kw: real_init(
        **kw, timeout=timedelta(seconds=join_timeout_s)
    )
    group: dict[str, Any] = {}
    while (msg := conn.recv()) is not None:
        op, kw = msg
        try:
            if op == "tensor":
                data = tp_worker.TpModelWorker.deserialize_own_rank(None, kw["payloads"])
                out: Any = updater.update_weights_from_tensor(
                    named_tensors=data, load_format=kw["load_format"]
                )
            elif op == "init":
                out = updater.init_weights_update_group(**kw)
                pg = updater._model_update_group.get(kw["group_name"])
                if pg is not None:  # SGLang's group is not in torch's registry: ask it
                    group.update(rank=pg.rank(), size=pg.size())
            elif op == "dist":
                named = updater._receive_bucketed_weights_from_distributed(**kw)
                out = updater.load_weights_from_distributed(named)
            elif op == "destroy":
                out = updater.destroy_weights_update_group(kw["group_name"])
            elif op == "checksums":
                sums = {n: tensor_checksum(t) for n, t in model.held.items()}
                out = {"checksums": sums, "tp_rank": tp_rank, "group": dict(group)}
            else:
                raise ValueError(op)
        except Exception as e:  # noqa: BLE001 - reported to the frontend like SGLang's errors
            out = (False, f"rank {tp_rank}: {type(e).__name__}: {e}")
        conn.send(out)


class TPTokenizerManager(EmbeddedTokenizerManager):
    """SGLang's tokenizer-manager slot: weight calls fan out to every TP rank, one result."""

    def __init__(self, model_path: str, server_args: Any, conns: list[Any]) -> None:
        from transformers import AutoConfig

        policy = types.SimpleNamespace(
            model_path=model_path,
            model=types.SimpleNamespace(config=AutoConfig.from_pretrained(model_path)),
            context_len=128,
        )
        super().__init__(policy, server_args)  # type: ignore[arg-type]
        self.conns = conns
        self._lock = threading.Lock()

    def _all(self, op: str, kws: list[dict[str, Any]]) -> list[Any]:
        with self._lock:  # one request at a time per rank pipe
            for conn, kw in zip(self.conns, kws, strict=True):
                conn.send((op, kw))
            return [conn.recv() for conn in self.conns]

    async def _fan_out(self, op: str, **kw: Any) -> tuple[bool, str]:
        outs = await asyncio.to_thread(self._all, op, [kw] * len(self.conns))
        bad = [msg for ok, msg in outs if not ok]
        return (False, "; ".join(bad)) if bad else (True, str(outs[0][1]))

    async def update_weights_from_tensor(self, obj: Any, request: Any = None):
        from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        if not self._session_open:
            return False, "update_weights_from_tensor must run between begin/end_weight_update()"
        payloads = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        ok, msg = await self._fan_out("tensor", payloads=payloads, load_format=obj.load_format)
        return self._after_update(obj, msg) if ok else (False, msg)

    async def init_weights_update_group(self, obj: Any, request: Any = None):
        return await self._fan_out(
            "init",
            master_address=obj.master_address,
            master_port=obj.master_port,
            rank_offset=obj.rank_offset,
            world_size=obj.world_size,
            group_name=obj.group_name,
            backend=obj.backend,
        )

    async def update_weights_from_distributed(self, obj: Any, request: Any = None):
        if not self._session_open:
            return False, "update_weights_from_distributed must run between begin/end"
        ok, msg = await self._fan_out(
            "dist",
            names=obj.names,
            dtypes=[getattr(torch, d) for d in obj.dtypes],
            shapes=obj.shapes,
            group_name=obj.group_name,
        )
        return self._after_update(obj, msg) if ok else (False, msg)

    async def destroy_weights_update_group(self, obj: Any, request: Any = None):
        return await self._fan_out("destroy", group_name=obj.group_name)

    async def check_weights(self, obj: Any, request: Any = None):
        ranks = await asyncio.to_thread(self._all, "checksums", [{}] * len(self.conns))
        return True, "Success", ranks, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--join-timeout-s", type=float, default=60.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.multiprocessing.set_sharing_strategy("file_system")  # payloads from another process
    app = _install_sglang_app(args.model_path)  # imports SGLang once, before forking the ranks
    ctx = mp.get_context("fork")
    conns = []
    for r in range(args.tp_size):
        parent, child = ctx.Pipe()
        ctx.Process(target=_rank_main, args=(child, r, args.join_timeout_s), daemon=True).start()
        conns.append(parent)
    tm = TPTokenizerManager(args.model_path, _INSTALLED["server_args"], conns)

    async def asgi(scope, receive, send):
        token = _CURRENT_TM.set(tm)
        try:
            await app(scope, receive, send)
        finally:
            _CURRENT_TM.reset(token)

    import uvicorn

    print(f"tp_engine {os.getpid()} tp={args.tp_size} on {args.host}:{args.port}", flush=True)
    uvicorn.run(asgi, host=args.host, port=args.port, lifespan="off", log_level="warning")


if __name__ == "__main__":
    main()
