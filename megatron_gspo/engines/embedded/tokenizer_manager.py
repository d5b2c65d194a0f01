"""`EmbeddedTokenizerManager`: the embedded engine's replacement for SGLang's `TokenizerManager`.

SGLang's HTTP routes (served unchanged by `server.py`) call this slice of its tokenizer
manager. It runs an `HFPolicy` (transformers, CPU) and keeps SGLang's control-plane semantics:
generation as readers and weight loads as a writer of one lock, weight-update sessions (400
outside one, with SGLang's messages), weight versions, pause/continue, abort, flush-cache
refusal while requests run, memory release/resume as bookkeeping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import types
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from megatron_gspo.engines.embedded.model import HFPolicy
from megatron_gspo.engines.routed_experts import RoutedExperts
from megatron_gspo.engines.sglang_loader import LOADER
from megatron_gspo.engines.weight_layout import unfuse_all
from megatron_gspo.engines.weight_shards import EngineLayout
from megatron_gspo.engines.wire import deserialize_named_tensors

if TYPE_CHECKING:
    from fastapi import Request
    from sglang.srt.managers import io_struct as io
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    # the requests that load weights and may name their weight version
    type _WeightUpdate = (
        io.UpdateWeightsFromTensorReqInput
        | io.UpdateWeightsFromDistributedReqInput
        | io.UpdateWeightFromDiskReqInput
    )


@dataclasses.dataclass(kw_only=True, slots=True)
class _ReqState:
    rid: str
    aborted: bool = False
    output_len: int = 0  # tokens generated so far (SGLang's state tracks its output ids too)


class EmbeddedTokenizerManager:
    """Implements the slice of SGLang's `TokenizerManager` that its HTTP routes call."""

    def __init__(
        self, policy: HFPolicy, server_args: ServerArgs, *, weight_version: str = "default"
    ) -> None:
        from sglang.srt.managers.tokenizer_manager import ServerStatus

        self.policy = policy
        self.server_args = server_args
        self.model_path = policy.model_path
        self.served_model_name = getattr(server_args, "served_model_name", None) or "embedded"
        self.weight_version = weight_version
        self.is_generation = True
        self.gracefully_exit = False
        self.server_status = ServerStatus.Up
        self.last_receive_tstamp = 0.0
        self.startup_time = time.time()
        self.initial_weights_loaded = True
        self.rid_to_state: dict[str, _ReqState] = {}
        self.model_config = types.SimpleNamespace(
            hf_config=policy.model.config,
            context_len=policy.context_len,
            is_image_understandable_model=False,
            is_audio_understandable_model=False,
        )
        self.num_requests_served = 0
        self.enable_return_routed_experts = False
        """SGLang's `--enable-return-routed-experts`: honour `return_routed_experts`."""
        self._session_open = False
        self._paused = False
        self._pause_mode = "abort"
        self._pause_event = threading.Event()
        self._pause_event.set()
        self._released: set[str] = set()
        self._groups: dict[str, torch.distributed.ProcessGroup] = {}
        self._inflight = 0
        self._writer = False
        self._cond: asyncio.Condition | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="embedded-gen")

    # ---- small SGLang accessors ------------------------------------------------------
    def config_value(self, name: str) -> Any:
        if name == "weight_version":
            return self.weight_version
        return getattr(self.server_args, name, None)

    def is_ready(self) -> bool:
        return True

    def is_healthy(self) -> bool:
        return True

    def create_abort_task(self, obj: io.GenerateReqInput) -> None:
        return None

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{"weight_version": self.weight_version}]

    # ---- reader/writer lock: generation = readers, weight loads = writer -------------
    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def _enter_reader(self) -> None:
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: not self._writer and not self._paused)
            self._inflight += 1

    async def _exit_reader(self) -> None:
        cond = self._condition()
        async with cond:
            self._inflight -= 1
            cond.notify_all()

    async def _writer_call(self, fn, *args):
        """Run a weight operation as SGLang does: immediately when paused in place / retracted,
        else exclusively. Paused with `abort`, the aborted requests drain first (SGLang's
        scheduler finishes them before it handles the update), so none of their tokens comes
        from the new weights and their reported weight version is the one they ran under."""
        if self._paused and self._pause_mode != "abort":
            return await asyncio.to_thread(fn, *args)
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: not self._writer and self._inflight == 0)
            self._writer = True
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            async with cond:
                self._writer = False
                cond.notify_all()

    # ---- generation ----------------------------------------------------------------------
    async def generate_request(self, obj: io.GenerateReqInput, request: Request | None = None):
        """Async generator yielding one dict (single request) or one list (batch)."""
        from sglang.srt.sampling.sampling_params import SamplingParams

        obj.normalize_batch_and_arguments()
        if obj.input_ids is None:
            raise ValueError("the embedded engine runs with --skip-tokenizer-init: send input_ids")
        # As SGLang: the field is honoured only when the server captures routes (its flag).
        routes = bool(obj.return_routed_experts) and self.enable_return_routed_experts
        if obj.is_single:
            items = [(obj.rid, obj.input_ids, obj.sampling_params)]
        else:
            items = []
            for i in range(obj.batch_size):
                sub = obj[i]
                for _ in range(obj.parallel_sample_num):
                    rid = sub.rid if obj.parallel_sample_num == 1 else uuid.uuid4().hex
                    items.append((rid, sub.input_ids, sub.sampling_params))
        specs = []
        for rid, ids, sp_dict in items:
            sp = SamplingParams(**(sp_dict or {}))
            sp.normalize(None)
            sp.verify(self.policy.vocab_size)
            if not ids:
                raise ValueError("input_ids cannot be empty")
            if max(ids) >= self.policy.vocab_size or min(ids) < 0:
                raise ValueError(f"input_ids out of vocabulary range [0, {self.policy.vocab_size})")
            if len(ids) >= self.policy.context_len:
                raise ValueError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({self.policy.context_len} tokens)."
                )
            specs.append((rid, list(ids), sp, routes))
        if self._released & {"weights", "kv_cache"}:
            raise ValueError(f"memory released ({sorted(self._released)}); resume it first")
        # As SGLang: a request that waits out a pause is not registered yet (so a weight update
        # during the pause sees no pending request), and registration and the pause's abort-all
        # are both atomic on this event loop, so a running request is always aborted by it.
        await self._enter_reader()
        for rid, *_ in specs:
            self.rid_to_state[rid] = _ReqState(rid=rid)
        try:
            loop = asyncio.get_running_loop()
            outs = await asyncio.gather(
                *(loop.run_in_executor(self._pool, self._run_one, *spec) for spec in specs)
            )
        finally:
            await self._exit_reader()
            for rid, *_ in specs:
                self.rid_to_state.pop(rid, None)
        self.last_receive_tstamp = time.time()
        self.num_requests_served += 1
        yield outs[0] if obj.is_single else outs

    def _run_one(
        self, rid: str, ids: list[int], sp: SamplingParams, routes: bool
    ) -> dict[str, Any]:
        tic = time.time()
        state = self.rid_to_state[rid]
        res = self.policy.generate(
            ids,
            sp,
            should_abort=lambda: state.aborted,
            on_token=lambda n: setattr(state, "output_len", n),
            wait_if_paused=self._wait_if_paused,
            return_routed_experts=routes,
        )
        out: dict[str, Any] = {
            "output_ids": res.output_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": res.finish_reason,
                "prompt_tokens": len(ids),
                "weight_version": self.weight_version,
                "completion_tokens": len(res.output_ids),
                "cached_tokens": 0,
                "e2e_latency": time.time() - tic,
                "output_token_logprobs": [
                    [lp, tok, None] for lp, tok in zip(res.logprobs, res.output_ids)
                ],
                "input_token_logprobs": [],
                "output_token_logprobs_length": len(res.output_ids),
            },
        }
        if res.routed_experts is not None:
            out["meta_info"]["routed_experts"] = RoutedExperts(indices=res.routed_experts).encode()
        return out

    def _wait_if_paused(self) -> bool:
        """Block while paused; True if this request was retracted (its KV must be rebuilt).
        Paused with `abort`, every running request is aborted: it returns at once instead."""
        if self._pause_event.is_set() or self._pause_mode == "abort":
            return False
        retracted = self._pause_mode == "retract"
        self._pause_event.wait()
        return retracted

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        # As SGLang 0.5.23's tokenizer manager (one worker): a rid it does not hold is ignored,
        # one it holds goes to the scheduler, which aborts every request it prefixes.
        if not abort_all and rid not in self.rid_to_state:
            return
        for state in list(self.rid_to_state.values()):
            if abort_all or (rid and state.rid.startswith(rid)):
                state.aborted = True

    async def pause_generation(self, obj: io.PauseGenerationReqInput) -> None:
        if obj.mode == "abort":
            self.abort_request(abort_all=True)
        self._pause_mode = obj.mode
        self._paused = True
        self._pause_event.clear()

    async def continue_generation(self, obj: io.ContinueGenerationReqInput) -> None:
        self._paused = False
        self._pause_event.set()
        cond = self._condition()
        async with cond:
            cond.notify_all()

    async def flush_cache(self, timeout_s: float = 0.0):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        if self.rid_to_state:
            return FlushCacheReqOutput(
                success=False,
                message="Cache not flushed because there are pending requests. "
                f"#queue-req: 0, #running-req: {len(self.rid_to_state)}",
            )
        return FlushCacheReqOutput(success=True)

    # ---- weights ---------------------------------------------------------------------------
    def _after_update(self, obj: _WeightUpdate, message: str) -> tuple[bool, str]:
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        if getattr(obj, "flush_cache", False) and self.rid_to_state:
            return False, (
                "Weights were updated, but the cache was not flushed because "
                "requests are still running or queued. Retract or finish them, "
                "then call /flush_cache."
            )
        return True, message

    async def begin_weight_update(
        self, obj: io.BeginWeightUpdateReqInput, request: Request | None = None
    ) -> tuple[bool, str]:
        if self._session_open:
            return False, (
                "a weight-update session is already open; call end_weight_update() first"
            )
        self._session_open = True
        return True, "Success"

    async def end_weight_update(
        self, obj: io.EndWeightUpdateReqInput, request: Request | None = None
    ) -> tuple[bool, str]:
        if not self._session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self._session_open = False
        return True, "Success"

    def _outside_session(
        self,
        obj: io.UpdateWeightsFromTensorReqInput | io.UpdateWeightsFromDistributedReqInput,
        route: str,
    ) -> tuple[bool, str] | None:
        """As SGLang: abort the running requests when asked, then refuse a load outside a
        weight-update session (its message); None: go on."""
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        if self._session_open:
            return None
        return False, f"{route} must run between begin_weight_update() and end_weight_update()"

    async def update_weights_from_tensor(
        self, obj: io.UpdateWeightsFromTensorReqInput, request: Request | None = None
    ):
        if (refused := self._outside_session(obj, "update_weights_from_tensor")) is not None:
            return refused
        # Our expert-slice loader (engines.sglang_loader) takes what `direct` takes and more.
        direct = obj.load_format in ("direct", LOADER)
        if not direct and obj.load_format not in (None, "flattened_bucket"):
            return False, f"embedded engine does not support load_format={obj.load_format!r}"
        if direct and len(obj.serialized_named_tensors) > 1:
            # Entry 0 of a per-rank cut is rank 0's shard only; this engine holds whole tensors.
            return False, (
                f"embedded engine got {len(obj.serialized_named_tensors)} per-rank payloads in "
                "SGLang's own layout but holds whole HF tensors; set weights.layout=hf"
            )
        # One engine = TP rank 0: deserialise our own rank's payload only, as SGLang does.
        payload = obj.serialized_named_tensors[0]

        def load() -> int:
            named = deserialize_named_tensors(payload, "direct" if direct else obj.load_format)
            if direct:  # SGLang's fused names (or slices): this engine holds HF names
                named = list(unfuse_all(named, EngineLayout.of(self.policy.model.config, 1)))
            return self.policy.load_weights(named)

        try:
            await self._writer_call(load)
        except Exception as e:  # a bad payload is the caller's error (400), as in SGLang
            return False, f"Failed to update weights: {e}"
        return self._after_update(obj, "Success")

    @staticmethod
    def _join_group(obj: io.InitWeightsUpdateGroupReqInput) -> torch.distributed.ProcessGroup:
        """Join the trainer's weight-update group as this engine's first rank, as SGLang does
        (blocks in the rendezvous); returns the process group."""
        from sglang.srt.utils import init_custom_process_group

        return init_custom_process_group(
            backend=obj.backend,
            init_method=f"tcp://{obj.master_address}:{obj.master_port}",
            world_size=obj.world_size,
            rank=obj.rank_offset,
            group_name=obj.group_name,
        )

    async def init_weights_update_group(
        self, obj: io.InitWeightsUpdateGroupReqInput, request: Request | None = None
    ):
        try:
            self._groups[obj.group_name] = await asyncio.to_thread(self._join_group, obj)
        except Exception as e:
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    async def destroy_weights_update_group(
        self, obj: io.DestroyWeightsUpdateGroupReqInput, request: Request | None = None
    ):
        pg = self._groups.pop(obj.group_name, None)
        if pg is None:
            return False, f"Group {obj.group_name} not in {list(self._groups)}."
        torch.distributed.destroy_process_group(pg)
        return True, "Succeeded to destroy custom process group."

    async def update_weights_from_distributed(
        self, obj: io.UpdateWeightsFromDistributedReqInput, request: Request | None = None
    ):
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        if (refused := self._outside_session(obj, "update_weights_from_distributed")) is not None:
            return refused
        if obj.group_name not in self._groups:
            return False, (
                f"Failed to receive weights: Group {obj.group_name} not in "
                f"{list(self._groups)}. Please call `init_weights_update_group` first."
            )
        pg = self._groups[obj.group_name]
        dtypes = [getattr(torch, d) for d in obj.dtypes]

        def receive_and_load() -> int:
            if obj.load_format == "flattened_bucket":
                bucket = FlattenedTensorBucket.empty(obj.names, dtypes, obj.shapes, "cpu")
                torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
                named = bucket.reconstruct_tensors()
            else:
                named = []
                for name, dtype, shape in zip(obj.names, dtypes, obj.shapes):
                    t = torch.empty(shape, dtype=dtype)
                    torch.distributed.broadcast(t, src=0, group=pg)
                    named.append((name, t))
            return self.policy.load_weights(named)

        try:
            await self._writer_call(receive_and_load)
        except Exception as e:
            return False, f"Failed to receive weights: {e}"
        return self._after_update(obj, "Succeeded to update parameter online.")

    async def update_weights_from_disk(
        self, obj: io.UpdateWeightFromDiskReqInput, request: Request | None = None
    ):
        if obj.abort_all_requests:
            self.abort_request(abort_all=True)
        try:
            await self._writer_call(self.policy.load_from_disk, obj.model_path)
        except Exception as e:
            return False, f"Failed to update weights: {e}.\nRolling back to original weights.", 0
        self.model_path = obj.model_path
        ok, message = self._after_update(obj, "Succeeded to update model weights.")
        return ok, message, 0

    async def update_weight_version(self, obj: io.UpdateWeightVersionReqInput) -> None:
        self.weight_version = obj.new_version

    async def get_weights_by_name(
        self, obj: io.GetWeightsByNameReqInput, request: Request | None = None
    ):
        return self.policy.get_weights_by_name(obj.name, obj.truncate_size)

    async def check_weights(self, obj: io.CheckWeightsReqInput, request: Request | None = None):
        import hashlib

        if obj.action != "checksum":
            msg = f"embedded engine supports action='checksum' only, got {obj.action}"
            return False, msg, None, None
        info = self.policy.checksums(obj.skip_tensor_list)
        info["parallelism_info"] = [
            dict(role="target", tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0,
                 pp_size=1, rank=0, size=1)
        ]  # fmt: skip
        engine_sum = hashlib.sha256(info["per_gpu_checksum"].encode()).hexdigest()
        return True, "Success", [info], engine_sum

    async def release_memory_occupation(
        self, obj: io.ReleaseMemoryOccupationReqInput, request: Request | None = None
    ) -> None:
        if self.rid_to_state:
            raise RuntimeError("release_memory_occupation requires an idle server")
        self._released |= set(obj.tags or ["weights", "kv_cache", "cuda_graph"])

    async def resume_memory_occupation(
        self, obj: io.ResumeMemoryOccupationReqInput, request: Request | None = None
    ) -> None:
        self._released -= set(obj.tags or ["weights", "kv_cache", "cuda_graph"])
