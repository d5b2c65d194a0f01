"""`weights:` config section: how trainer weights reach the rollout engines.

A light module (the config helpers only, no torch) so that `config.py` imports neither the
sync machinery nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from megatron_gspo.config_io import FLOAT_DTYPES, ConfigError, at_least, port, positive

if TYPE_CHECKING:
    import torch

__all__ = ["WeightSyncConfig", "check_fp8_sync"]


@dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How trainer weights reach the rollout engines."""

    transport: Literal["tensor", "distributed", "disk"] = "tensor"
    """tensor: colocated (same node, IPC); distributed: a process group with the engines;
    disk: a HF checkpoint directory per version (`disk_dir`) that engines reload."""
    layout: Literal["auto", "hf", "engine"] = "auto"
    """How pushed tensors are named and cut. engine: SGLang's own fused parameters (qkv_proj,
    gate_up_proj, the experts stacked in w13_weight / w2_weight), one tensor per fused
    parameter, each engine rank sent its own part, loaded by name (`load_format="direct"`:
    no name mapping, no per-expert copy on the engine); tensor transport only, not with fp8.
    hf: one tensor per HF checkpoint tensor, mapped by the engine's `load_weights` (every
    transport; engines that need HF names). auto: engine with `transport=tensor` and `fp8`
    off, else hf; chosen by measurement: on CPU into the real SGLang server
    (docs/performance.md, "SGLang's own layout") the engine layout, written in one pass
    straight into each engine rank's shared buffer, pushed end to end faster than HF names
    (small model 2.2x, 2 GB model see there); with `senders=owners` every rank sends its
    engine ranks' fused parameters (`weights.owners_fused`; HF names where the trainer's and
    the engines' EP sizes do not nest, said once in the log)."""
    bucket_mb: float = 512.0
    """Upper bound of one bucket in MiB (a single larger tensor is sent alone)."""
    dtype: str | None = None
    """Send dtype ("bfloat16", "float32"); None keeps the trainer's. Match the engine's dtype."""
    fp8: bool = False
    """Blockwise FP8 (e4m3, 128x128, `weight_scale_inv`) for decoder linear weights; the
    rest go as `dtype` or bf16. The engines must serve an FP8 block checkpoint config."""
    fp8_check: bool = True
    """Dequantise every FP8 weight on the sender and check the e4m3 error bound per block."""
    verify_every: int = 20
    """Compare per-tensor checksums with the engines on the first push, on every push whose
    version is a multiple of N, and on every push that an engine re-joins (restarted, or back
    from a hang: it serves only once verified); 0 = never. A verified push costs about one
    sha256 per sent byte on each side: measured on CPU at 55%, 74% and 98% of an unverified
    push (benchmarks/weight_sync.py, three runs at load 8-24; docs/performance.md), so N=20
    costs <= 5% of sync time per push on average, <= 10% counting the first push from the
    10th push on. At Qwen3-30B-A3B scale on GPUs the projection is ~10x a push: set ~100."""
    overlap: bool = True
    """Double buffering on the sender: checksum and send each bucket on a worker thread while
    the next one is exported (`weights.pipeline`); holds up to 3 buckets at once. False:
    export, checksum and send one after the other (the order and bytes sent are the same)."""
    verify_names: Literal["all", "common"] = "all"
    """all: every sent tensor must be reported by the engine, under its HF name or, for a real
    SGLang server, under SGLang's fused parameter name; common: only names the engine reports
    are compared."""
    check_version: bool = True
    """Require every engine to report the new weight version after a sync."""
    sender_rank: int = 0
    """Global trainer rank that keeps and sends the buckets (`senders=one`)."""
    senders: Literal["one", "owners"] = "one"
    """one: `sender_rank` receives every tensor (experts gathered to it) and sends them all;
    owners: every rank that holds a shard sends it, no weight is gathered for the push
    (`weights.owners`): with `transport=tensor` each node's ranks push the whole model to that
    node's engines (colocated on any number of nodes; every EP rank must be on each node),
    with `distributed` each rank has its own weight-update group to every engine. In SGLang's
    layout with the engines on the trainer's GPUs (launched by the job, or
    `rollout.client.engine_gpu_ids`), each engine rank is fed only by the trainer rank on its
    GPU (`weights.owners_home`). Rank 0 still opens and closes the session and stamps the version.
    Not with `transport=disk`."""
    experts_to_first: bool = True
    """Gather expert weights to EP rank 0 only (the sender), not to every EP rank; False keeps
    megatron-bridge's all-gather (see `stream.experts_to_ep_rank0`)."""
    batch_expert_gathers: bool = True
    """With experts_to_first: gather experts to EP rank 0 in batches of about one bucket, one
    collective per batch, instead of the bridge's one per expert tensor (`weights.ep_batch`;
    the bytes received are the same). False: the bridge's per-tensor gathers."""
    grouped_export: Literal["auto", "off"] = "auto"
    """Where a push in SGLang's own layout takes the experts from. auto: each rank's local
    experts straight from its Megatron expert parameters (per layer, `linear_fc1` = [gate; up]
    and `linear_fc2` = down, the same bytes as the bridge's export), so the bridge walks only
    the other tensors (`weights.grouped`); the bridge's per-HF-tensor export of the experts
    where that cannot serve (expert TP or PP above 1, non-gated or legacy grouped MLPs, FP8
    export, a bridge without conversion tasks; said once in the log), and always for HF-named
    and FP8 pushes. off: the bridge's export of every expert tensor (the path before;
    benchmarks compare the two in one run)."""
    expert_slices: Literal["auto", "off"] = "auto"
    """How `weights.senders=owners` sends an engine rank's stacked experts (`w13_weight` /
    `w2_weight`) that several trainer EP ranks hold. auto: each sends its own experts as a
    slice of the parameter, straight into place (no gather between trainer ranks), when every
    engine loads slices (SGLang started with our `--custom-weight-loader`, which the launcher
    passes: `engines.sglang_loader`; the embedded engine) and the push is not verified (the
    engine hashes whole parameters); otherwise, or off: the holders first send theirs to one of
    them, which sends the whole parameter (`load_format="direct"`)."""
    disk_dir: str | None = None
    """Root directory of the disk transport (must be visible to the engines); None in a run
    config: `<logging.dir>/weights`."""
    disk_keep: int = 2
    """Versions kept on disk."""
    engine_ep_size: int = 1
    """Expert-parallel size inside each engine (SGLang `--ep-size`), which decides what each
    engine TP rank holds of the experts (verification); set from rollout.launch.ep_size when
    the trainer launches the engines."""
    engine_device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the engines hold their weights, which decides how SGLang's `/weights_checker`
    hashes them (sha256 of the bytes on CPU, its Triton `gpu_tensor_hash` on CUDA) and so the
    function and device the sender predicts the checksums with. auto: cpu for launched
    embedded engines and `rollout.launch.device=cpu`, cuda for launched SGLang engines on a
    GPU device; otherwise (external engines) cuda when this trainer sees a CUDA device, else
    cpu. Set it when external engines run on another kind of device than the trainer. (An
    embedded engine, which reports HF names, is always checked with the CPU branch.)"""
    master_address: str | None = None
    """Address of the sender for the distributed transport's rendezvous, which every engine
    rank connects to (and the sender's gloo device binds). None: the local address that routes
    to the engines (`transports.routable_address`; a remote engine's route, never loopback,
    when any engine is on another host)."""
    master_port: int = 0
    """Port of that rendezvous (one group per engine pool: pool i uses `master_port + i`);
    0: a free port, picked per pool."""
    group_name: str = "weight_update_group"
    """Name of the distributed transport's process group on the engines."""
    backend: str | None = None
    """Distributed transport backend; None: nccl with CUDA, gloo otherwise."""
    timeout_s: float = 600.0
    """Timeout of the distributed transport's rendezvous and collectives."""

    def __post_init__(self) -> None:
        at_least("weights", 0, sender_rank=self.sender_rank)
        port("weights", master_port=self.master_port)
        positive("weights", disk_keep=self.disk_keep, timeout_s=self.timeout_s)
        if self.transport not in ("tensor", "distributed", "disk"):
            raise ConfigError(f"weights.transport={self.transport!r}: tensor|distributed|disk")
        if self.layout not in ("auto", "hf", "engine"):
            raise ConfigError(f"weights.layout={self.layout!r}: auto|hf|engine")
        if self.layout == "engine" and (self.transport != "tensor" or self.fp8):
            raise ConfigError(
                f"weights.layout=engine needs weights.transport=tensor without weights.fp8 "
                f"(transport={self.transport}, fp8={self.fp8}): SGLang 0.5.23 loads its own "
                "names only through update_weights_from_tensor; set weights.layout=hf or auto"
            )
        if self.bucket_mb <= 0:
            raise ConfigError(f"weights.bucket_mb={self.bucket_mb} must be > 0")
        if self.dtype is not None and self.dtype not in FLOAT_DTYPES:
            raise ConfigError(
                f"weights.dtype={self.dtype!r} is not a floating-point torch dtype name "
                f"({', '.join(sorted(FLOAT_DTYPES))})"
            )
        if self.senders not in ("one", "owners"):
            raise ConfigError(f"weights.senders={self.senders!r}: one|owners")
        if self.senders == "owners" and self.transport == "disk":
            raise ConfigError(
                "weights.senders=owners sends from every rank, but weights.transport=disk writes "
                "one checkpoint directory from one rank; set weights.senders=one"
            )
        if self.senders == "owners" and self.sender_rank != 0:
            raise ConfigError(
                f"weights.sender_rank={self.sender_rank} with weights.senders=owners: rank 0 "
                "coordinates the session; leave weights.sender_rank=0"
            )
        if self.verify_every < 0:
            raise ConfigError("weights.verify_every must be >= 0")
        if self.engine_ep_size < 1:
            raise ConfigError(f"weights.engine_ep_size={self.engine_ep_size} must be >= 1")
        if self.expert_slices not in ("auto", "off"):
            raise ConfigError(f"weights.expert_slices={self.expert_slices!r}: auto|off")
        if self.grouped_export not in ("auto", "off"):
            raise ConfigError(f"weights.grouped_export={self.grouped_export!r}: auto|off")
        if self.engine_device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"weights.engine_device={self.engine_device!r}: auto|cpu|cuda")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"weights.master_port={self.master_port}: 0 (free) or a TCP port")

    def resolved_engine_device(self) -> str:
        """`engine_device` with auto decided in this process (cuda if torch sees a GPU)."""
        if self.engine_device != "auto":
            return self.engine_device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_layout(self) -> str:
        """`layout` with auto decided (see `layout`)."""
        if self.layout != "auto":
            return self.layout
        return "engine" if self.transport == "tensor" and not self.fp8 else "hf"

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024**2)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return None if self.dtype is None else getattr(torch, self.dtype)


def check_fp8_sync(weights: WeightSyncConfig, *, embedded: bool, fp8_engine: bool) -> None:
    """FP8 sync and the engines agree: the embedded engine holds exactly what it is sent
    (checked bitwise), block FP8 when it emulates FP8 inference (`fp8_engine`), the trainer's
    dtype otherwise; real servers quantise what they receive."""
    if weights.fp8 and embedded and not fp8_engine:
        raise ConfigError(
            "weights.fp8=true needs SGLang engines or the embedded engine's FP8 emulation; set "
            "weights.fp8=false, rollout.launch.quantization=fp8 or rollout.launch.backend=sglang"
        )
    if fp8_engine and not weights.fp8:
        raise ConfigError(
            "rollout.launch.quantization=fp8 on the embedded engine holds block-FP8 weights, "
            "which only FP8 sync sends; set weights.fp8=true or rollout.launch.quantization=null"
        )
