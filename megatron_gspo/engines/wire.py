"""SGLang 0.5.23 wire protocol: request bodies, weight payloads, response parsing, validation.

Everything that knows SGLang's JSON field names or its Python classes lives here (plus the
embedded engine), so a version bump touches one place; `tests/engines/test_drift.py` pins the
routes and fields listed in `ROUTES`. SGLang modules are imported lazily: importing
`sglang.srt` costs ~15 s, and only the weight-payload, checksum and validation helpers
need it.
"""

from __future__ import annotations

import functools
import json
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

#: route -> (HTTP methods the bridge uses, SGLang request class validating the body or None).
ROUTES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "/generate": (("POST",), "GenerateReqInput"),
    "/health": (("GET",), None),
    "/health_generate": (("GET",), None),
    "/model_info": (("GET",), None),
    "/server_info": (("GET",), None),
    "/flush_cache": (("POST",), None),
    "/abort_request": (("POST",), "AbortReq"),
    "/pause_generation": (("POST",), "PauseGenerationReqInput"),
    "/continue_generation": (("POST",), "ContinueGenerationReqInput"),
    "/begin_weight_update": (("POST",), "BeginWeightUpdateReqInput"),
    "/end_weight_update": (("POST",), "EndWeightUpdateReqInput"),
    "/update_weights_from_tensor": (("POST",), "UpdateWeightsFromTensorReqInput"),
    "/init_weights_update_group": (("POST",), "InitWeightsUpdateGroupReqInput"),
    "/update_weights_from_distributed": (("POST",), "UpdateWeightsFromDistributedReqInput"),
    "/destroy_weights_update_group": (("POST",), "DestroyWeightsUpdateGroupReqInput"),
    "/update_weights_from_disk": (("POST",), "UpdateWeightFromDiskReqInput"),
    "/update_weight_version": (("POST",), "UpdateWeightVersionReqInput"),
    "/release_memory_occupation": (("POST",), "ReleaseMemoryOccupationReqInput"),
    "/resume_memory_occupation": (("POST",), "ResumeMemoryOccupationReqInput"),
    "/weights_checker": (("POST",), "CheckWeightsReqInput"),
    "/get_weights_by_name": (("POST",), "GetWeightsByNameReqInput"),
}

#: request fields the bridge sends, per SGLang request class (pinned by the drift test).
FIELDS_SENT: dict[str, tuple[str, ...]] = {
    "GenerateReqInput": (
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "return_routed_experts",
    ),
    "UpdateWeightsFromTensorReqInput": (
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "weight_version",
    ),
    "InitWeightsUpdateGroupReqInput": (
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
    ),
    "UpdateWeightsFromDistributedReqInput": (
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "load_format",
        "flush_cache",
        "weight_version",
    ),
    "DestroyWeightsUpdateGroupReqInput": ("group_name",),
    "UpdateWeightFromDiskReqInput": ("model_path", "weight_version"),
    "UpdateWeightVersionReqInput": ("new_version", "abort_all_requests"),
    "ReleaseMemoryOccupationReqInput": ("tags",),
    "ResumeMemoryOccupationReqInput": ("tags",),
    "PauseGenerationReqInput": ("mode",),
    "ContinueGenerationReqInput": (),
    "BeginWeightUpdateReqInput": (),
    "EndWeightUpdateReqInput": (),
    "AbortReq": ("rid", "abort_all"),
    "CheckWeightsReqInput": ("action",),
    "GetWeightsByNameReqInput": ("name", "truncate_size"),
}


# ---- request bodies ---------------------------------------------------------------------
def generate_body(
    input_ids: Sequence[Sequence[int]],
    sampling_params: Sequence[dict[str, Any]],
    rids: Sequence[str],
) -> dict[str, Any]:
    """A batched `/generate` body: one entry per (prompt, sample), each with its own rid.

    The bridge expands groups itself (n=1 per entry) instead of using SGLang's `n`: SGLang
    regenerates the rid of every `n>1` sample, and with a `sampling_seed` all `n` samples
    would share one seed. Own rids let a sample be aborted, retried and matched exactly.
    """
    if not (len(input_ids) == len(sampling_params) == len(rids)) or not rids:
        raise ValueError("input_ids, sampling_params and rids must be non-empty, same length")
    return {
        "input_ids": [list(map(int, p)) for p in input_ids],
        "sampling_params": list(sampling_params),
        "rid": list(rids),
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def generate_body_single(
    input_ids: Sequence[int], sampling_params: dict[str, Any], rid: str
) -> dict[str, Any]:
    """A one-prompt `/generate` body. `sglang-router` (0.3.x) only admits this form plus the
    native-`n` one: its schema wants `sampling_params` as one object and `rid` as a string."""
    return {
        "input_ids": list(map(int, input_ids)),
        "sampling_params": dict(sampling_params),
        "rid": rid,
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def generate_body_native_n(
    input_ids: Sequence[Sequence[int]], sampling_params: dict[str, Any], n: int
) -> dict[str, Any]:
    """A `/generate` body using SGLang's own `n` (response order is prompt-major)."""
    return {
        "input_ids": [list(map(int, p)) for p in input_ids],
        "sampling_params": dict(sampling_params, n=n),
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def dtype_name(dtype: torch.dtype | str) -> str:
    """SGLang's dtype spelling (`getattr(torch, name)` on the server)."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    return str(dtype).removeprefix("torch.")


# ---- responses ----------------------------------------------------------------------------
def as_response_list(payload: object) -> list[dict[str, Any]]:
    """SGLang answers a batch with a JSON list and a single prompt with an object."""
    if isinstance(payload, list):
        return payload
    if isinstance(payload, dict):
        return [payload]
    raise ValueError(f"unexpected /generate response type {type(payload).__name__}")


def error_message(body: bytes | str) -> str:
    """SGLang's error text from any of its error envelopes (falls back to the raw body)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
    except ValueError:
        return _one_line(text)
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(err, str):
            return err
        if "message" in obj:
            return str(obj["message"])
    return text.strip()


def _one_line(text: str, limit: int = 200) -> str:
    """A body that is not SGLang's JSON as one short line: an HTML page (a URL that is a plain
    web server, a proxy's error page) by its title; anything else with its whitespace folded,
    cut at `limit` characters (was: the raw page, tens of lines, in every message)."""
    low = text.lower()
    if "<html" in low or "<!doctype html" in low:
        start, end = low.find("<title>"), low.find("</title>")
        title = " ".join(text[start + 7 : end].split()) if 0 <= start < end else ""
        return f"an HTML page{f' titled {title[:80]!r}' if title else ''}, not an SGLang answer"
    folded = " ".join(text.split())
    return folded if len(folded) <= limit else folded[:limit] + "..."


# ---- weight payloads --------------------------------------------------------------------
def _sglang_weight_sync():
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return MultiprocessingSerializer, FlattenedTensorBucket


def flatten_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]):
    """SGLang's `FlattenedTensorBucket` over the tensors (one uint8 buffer + metadata)."""
    _, bucket_cls = _sglang_weight_sync()
    return bucket_cls(named_tensors=list(named_tensors))


def serialize_flattened_bucket(
    named_tensors: Sequence[tuple[str, torch.Tensor]], *, tp_size: int = 1
) -> tuple[list[str], Any]:
    """`serialized_named_tensors` for `load_format="flattened_bucket"`, one entry per TP rank.

    SGLang's TP rank r decodes entry r only (`TpModelWorker.deserialize_own_rank`), so an
    engine of TP size t needs t entries. Each entry is its own `MultiprocessingSerializer`
    call, as SGLang's `Engine._serialize_tensors_per_rank` does: a CUDA-IPC handle is
    reference-counted per serialisation, and one copy opened by two ranks would release the
    producer's memory twice. Returns (payloads, bucket): keep `bucket` alive until the HTTP
    call returns, since a payload is a shared-memory / CUDA-IPC handle, not a copy. CPU tensors
    cross unrelated processes only with the `file_system` sharing strategy, so it is switched
    on here (the embedded engine does the same on its side).
    """
    bucket = flatten_bucket(named_tensors)
    return bucket_payloads(bucket, tp_size), bucket


def bucket_payloads(bucket: FlattenedTensorBucket, tp_size: int) -> list[str]:
    """`tp_size` separate serialisations of one `FlattenedTensorBucket` (see above): several
    engines share one flattened copy of the weights, each rank gets its own handle."""
    if tp_size < 1:
        raise ValueError(f"tp_size={tp_size} must be >= 1")
    serializer, _ = _sglang_weight_sync()
    flat = bucket.get_flattened_tensor()
    if not flat.is_cuda:
        torch.multiprocessing.set_sharing_strategy("file_system")
    obj = {"flattened_tensor": flat, "metadata": bucket.get_metadata()}
    return [serializer.serialize(obj, output_str=True) for _ in range(tp_size)]


class DirectPiece(Protocol):
    """One tensor of a rank's `direct` payload (`engines.weight_layout.RankPiece`)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def sources(self) -> list[torch.Tensor]: ...

    @property
    def nbytes(self) -> int: ...


_ALIGN = 64
"""Byte alignment of each tensor in a rank's buffer (any dtype's itemsize divides it)."""


def payload_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 buffer another process maps without a copy when it is serialised: on CPU a
    fresh shared-memory segment (`file_system` strategy: serialising it passes its name, where
    a private buffer would first be copied into shared memory); on CUDA device memory (its
    IPC handle)."""
    if device.type == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    # CPU tensors cross unrelated processes only by file name (the server is no child of ours).
    torch.multiprocessing.set_sharing_strategy("file_system")
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))


def direct_payloads_from_pieces(
    per_rank: Sequence[Sequence[DirectPiece]],
    buffers: dict[int, torch.Tensor] | None = None,
) -> tuple[list[str], list[torch.Tensor]]:
    """`direct_payloads_for_engines` for one engine."""
    payloads, keep = direct_payloads_for_engines(per_rank, 1, buffers)
    return payloads[0], keep


def direct_payloads_for_engines(
    per_rank: Sequence[Sequence[DirectPiece]],
    engines: int,
    buffers: dict[int, torch.Tensor] | None = None,
) -> tuple[list[list[str]], list[torch.Tensor]]:
    """`serialized_named_tensors` for `load_format="direct"`: entry r is rank r's own
    `[(sglang_name, tensor), ...]` list (SGLang's rank r decodes entry r only and copies each
    tensor into the parameter of that name).

    Each rank's tensors are views of ONE buffer (`payload_buffer`: one shared-memory segment or
    CUDA-IPC handle per rank, not one per tensor), and each piece's sources are copied (cast to
    its dtype) straight into their place in it: the only pass over the bytes on the sender.
    Returns (payloads, keep): `payloads[i]` for engine i of `engines` sharing the buffers,
    each its own serialisation (a shared-memory segment is reference-counted per
    serialisation: one payload opened by two engines drops the count to zero and unlinks the
    segment while the sender still holds it); keep `keep` alive until the HTTP calls return
    (the payloads are handles onto it).

    buffers: host buffers to reuse, by rank, kept by the caller across calls (a fresh
    shared-memory segment costs a page fault per 4 KiB on first write: measured 5.8x the
    time of writing a warm one). Only for callers that wait for the engines' answer before
    the next call (the engine has copied the payload out by then)."""
    serializer, _ = _sglang_weight_sync()
    payloads: list[list[str]] = [[] for _ in range(engines)]
    keep = []
    for rank, pieces in enumerate(per_rank):
        if not pieces:
            # Nothing for this rank in this request (another sender feeds it: the colocated
            # home path): SGLang's rank reads its own entry only, and `direct` with an empty
            # list loads nothing (0.5.23 `_model_load_weights_direct`).
            for one in payloads:
                one.append(serializer.serialize([], output_str=True))
            continue
        offsets, total = [], 0
        for piece in pieces:
            offsets.append(total)
            total += -(-piece.nbytes // _ALIGN) * _ALIGN
        device = pieces[0].sources[0].device if pieces else torch.device("cpu")
        held = buffers.get(rank) if buffers is not None and device.type == "cpu" else None
        if held is not None and held.numel() >= total:
            flat = held
        else:
            flat = payload_buffer(total, device)
            if buffers is not None and device.type == "cpu":
                buffers[rank] = flat
        views = []
        for piece, offset in zip(pieces, offsets, strict=True):
            out = flat[offset : offset + piece.nbytes].view(piece.dtype)
            pos = 0
            for src in piece.sources:
                out[pos : pos + src.numel()].view(src.shape).copy_(src)
                pos += src.numel()
            if pos != out.numel():
                raise ValueError(f"{piece.name}: sources hold {pos} elements, shape {piece.shape}")
            views.append((piece.name, out.view(piece.shape)))
        for one in payloads:
            one.append(serializer.serialize(views, output_str=True))
        keep.append(flat)
    return payloads, keep


@dataclass(frozen=True, slots=True)
class _Whole:
    """A tensor sent as it is (one source): `direct_payloads`' pieces."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.sources[0].numel() * self.sources[0].element_size()


def direct_payloads(
    per_rank: Sequence[Sequence[tuple[str, torch.Tensor]]],
) -> tuple[list[str], list[torch.Tensor]]:
    """`direct_payloads_from_pieces` of whole tensors: entry r is rank r's
    `[(sglang_name, tensor), ...]`, sent as they are."""
    pieces = [
        [_Whole(n, tuple(t.shape), t.dtype, [t]) for n, t in named] for named in per_rank
    ]
    return direct_payloads_from_pieces(pieces)


def deserialize_named_tensors(
    payload: str | bytes, load_format: str | None = "flattened_bucket"
) -> list[tuple[str, torch.Tensor]]:
    """Decode one rank's payload exactly as SGLang's server does (allow-list unpickler).

    `flattened_bucket` payloads hold `{"flattened_tensor", "metadata"}`; the other formats a
    plain `[(name, tensor), ...]` list.
    """
    serializer, bucket_cls = _sglang_weight_sync()
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    (payload,) = normalize_serialized_named_tensor_payloads([payload])
    obj = serializer.deserialize(payload)
    if load_format != "flattened_bucket":
        return [(str(n), t) for n, t in obj]
    bucket = bucket_cls(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
    return bucket.reconstruct_tensors()


# ---- checksums: SGLang's own function, on the device the engine holds its weights on -------
ENGINE_DEVICES: tuple[str, ...] = ("cpu", "cuda")
"""Devices whose `/weights_checker` hash the trainer can predict: SGLang's `tensor_hash` takes
sha256 of the bytes for every tensor that is not CUDA (CPU, and XPU/NPU after `.cpu()`) and
its Triton `gpu_tensor_hash` for CUDA tensors (ROCm included)."""


@functools.cache
def _weight_checker() -> types.ModuleType:
    # Lazy: importing sglang.srt costs seconds, and config/planner must stay sglang-free.
    try:
        from sglang.srt.utils import weight_checker
    except ImportError as e:
        raise RuntimeError(
            f"verifying a weight sync computes SGLang's own checksums, but sglang's Python "
            f"modules do not import here ({e}); install sglang==0.5.23 (constraints.txt) or set "
            "weights.verify_every=0"
        ) from e
    return weight_checker


def on_engine_device(t: torch.Tensor, device: str) -> torch.Tensor:
    """`t` on the device an engine holds its weights on, so that SGLang's `tensor_hash` takes
    the branch the engine takes (it dispatches on `tensor.is_cuda`)."""
    if device == "cpu":
        return t.detach().cpu()
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the engines hold their weights on CUDA, where SGLang checksums with its Triton "
                "gpu_tensor_hash, but this trainer process sees no CUDA device to compute it "
                "on; set weights.engine_device=cpu if the engines run on CPU, or "
                "weights.verify_every=0"
            )
        return t.detach().to("cuda")
    raise ValueError(f"engine device {device!r}: one of {', '.join(ENGINE_DEVICES)}")


def tensor_checksum(t: torch.Tensor, device: str = "cpu") -> str:
    """SGLang's `/weights_checker` checksum of `t` as an engine holding it on `device` reports
    it: SGLang's own `weight_checker._hash_tensor` (`f"{mm_utils.tensor_hash(t):016x}"`) called
    on `t` moved to that device, never a re-implementation: sha256 of the raw bytes (first 8)
    on CPU, the Triton `gpu_tensor_hash` on CUDA, whatever later SGLang versions make of them."""
    return str(_weight_checker()._hash_tensor(on_engine_device(t, device)))


def fused_checksum(parts: Sequence[torch.Tensor], device: str = "cpu") -> str:
    """The checksum of the one tensor an engine holds where the trainer sends `parts` (a fused
    qkv_proj, gate_up_proj or stacked experts: the parts' bytes back to back, in order),
    assembled on `device` and hashed there by SGLang's function (`tensor_checksum`)."""
    if not parts:
        raise ValueError("a fused parameter has at least one part")
    dtype = parts[0].dtype
    if any(p.dtype != dtype for p in parts):
        raise ValueError(f"fused parts differ in dtype: {sorted({str(p.dtype) for p in parts})}")
    dev = "cuda" if device == "cuda" else "cpu"
    on_engine_device(parts[0][:0], device)  # the one-line error before allocating
    out = torch.empty(sum(p.numel() for p in parts), dtype=dtype, device=dev)
    offset = 0
    for p in parts:
        out[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
        offset += p.numel()
    return tensor_checksum(out, device)


def fp8_checksummed_weight(
    q: torch.Tensor, scale_inv: torch.Tensor, device: str = "cpu", block: int = 128
) -> torch.Tensor:
    """The tensor SGLang's `/weights_checker` hashes for a block-FP8 weight: its bf16
    dequantisation by SGLang's own `Fp8BlockComparable.dequantize` (`block_quant_dequant`),
    computed on the engine's device. SGLang dequantises the parameter it holds (fused, per TP
    rank); every block is dequantised on its own, so this equals the matching part of it for
    any block-aligned fusing or sharding.

    The comparable infers the block edge as K / Kb, which is `block` whenever K is a multiple
    of it (every real model). Below that (tiny test models: K < 128) the inference is wrong and
    its repeat fails, so there SGLang's `block_quant_dequant` is called with `block` itself."""
    _weight_checker()  # the one-line error if sglang does not import
    from sglang.srt.utils import weight_checker_comparator as wcc

    q, scale_inv = on_engine_device(q, device), on_engine_device(scale_inv, device)
    if q.shape[-1] // scale_inv.shape[-1] == block:
        return wcc.Fp8BlockComparable(q, scale_inv).dequantize(torch.bfloat16)
    return wcc.block_quant_dequant(q, scale_inv.float(), [block, block], dtype=torch.bfloat16)


def overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's `per_gpu_checksum` over per-tensor checksums (its own `overall_checksum`)."""
    return str(_weight_checker().overall_checksum(checksums))


# ---- validation with SGLang's own code (tests, and `validate=True` clients) ----------------
@functools.cache
def _io_struct():
    from sglang.srt.managers import io_struct

    return io_struct


def validate_generate_body(body: dict[str, Any], vocab_size: int | None = None) -> None:
    """Run the checks SGLang's server runs on a `/generate` body; raise ValueError if refused.

    The JSON contract gate (`generate_contract_error`, an HTTP 400 on the server), the FastAPI
    body parse into `GenerateReqInput`, `normalize_batch_and_arguments()` and
    `SamplingParams(...).verify()`.
    """
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams as SgSamplingParams

    err = generate_contract_error(json.loads(json.dumps(body)))
    if err is not None:
        raise ValueError(f"SGLang contract rejects /generate body: {err}")
    obj = TypeAdapter(_io_struct().GenerateReqInput).validate_python(json.loads(json.dumps(body)))
    obj.normalize_batch_and_arguments()
    sps = body["sampling_params"]
    for sp in sps if isinstance(sps, list) else [sps]:
        p = SgSamplingParams(**sp)
        p.normalize(None)
        p.verify(vocab_size if vocab_size is not None else 1 << 30)


def validate_control_body(route: str, body: dict[str, Any]):
    """Parse a control-plane body with the SGLang request class FastAPI would use."""
    from pydantic import TypeAdapter

    cls_name = ROUTES[route][1]
    if cls_name is None:
        raise ValueError(f"{route} takes no body")
    cls = getattr(_io_struct(), cls_name)
    return TypeAdapter(cls).validate_json(json.dumps(body))


def validate_generate_response(item: dict[str, Any]) -> None:
    """Parse one `/generate` response item with SGLang's `GenerateResponse` schema."""
    from sglang.api.v1.api_types import GenerateResponse

    GenerateResponse.from_json_value(item)
