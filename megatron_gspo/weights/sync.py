"""`WeightSync`: push the trainer's weights to the rollout engines once per step, verified.

Every trainer rank calls `sync.push(model)` (the bridge's gathers are collectives); rank 0
(`sender_rank`) buckets the HF-named tensors (expert gathers batched per bucket,
`weights.ep_batch`), optionally quantises them to block FP8 (bound checked on the device, read
once per bucket), and hands each bucket to a worker thread that checksums and sends it while
the next one is exported (`weights.pipeline`), then checks, when due:

* integrity: the per-tensor checksum of every tensor as sent equals what each engine reports
  through `WeightReceiver.weights_checksum()` (a mismatch raises `WeightIntegrityError` naming
  the tensor). Engines that report HF names (the embedded engine) are compared name by name;
  a real SGLang server reports its own fused parameters (qkv_proj, gate_up_proj, stacked
  experts w13_weight/w2_weight), one entry per TP rank over that rank's shard, which the
  sender reproduces from what it sent, sharded as SGLang's weight loaders shard
  (`engines.weight_shards.EngineChecksums`: TP and engine-EP sizes from the engine pool and
  `weights.engine_ep_size`); FP8 weights as SGLang hashes them, dequantised with their
  `weight_scale_inv`, so a wrong FP8 byte or scale is caught too.
* version: each engine reports the new version (`WeightReceiver.weight_version()`), which
  rollouts then carry.

With `weights.senders=owners` every rank sends the tensors it holds instead (in SGLang's own
layout where it applies: `weights.owners_fused`), rank 0 only opening and closing the session
and checking (`weights.owners`).

The outcome is broadcast from the sender so that every rank returns or raises together.
Call `push` once the parameters hold the new weights: with the distributed optimizer's
`overlap_param_gather`, the all-gather of updated parameters finishes only in the next forward,
so force it first (`model_chunk.start_param_sync(force_sync=True)` on each chunk).

    sync = WeightSync(bridge, engine, WeightSyncConfig(transport="tensor", fp8=True))
    for step in ...:
        train_step(...)
        report = sync.push(model)   # all ranks; report.version == sync.version
    sync.close()
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from megatron_gspo import dist, layout
from megatron_gspo.engines.protocols import NoEnginesLeft, WeightReceiver
from megatron_gspo.engines.sglang_loader import LOADER
from megatron_gspo.engines.weight_layout import RankChecksums, Sendable, engine_layout
from megatron_gspo.engines.weight_shards import EngineChecksums, EngineLayout
from megatron_gspo.weights import fp8 as fp8_lib
from megatron_gspo.weights import hf_io
from megatron_gspo.weights import owners as owners_lib
from megatron_gspo.weights.checksum import WeightIntegrityError
from megatron_gspo.weights.config import WeightSyncConfig
from megatron_gspo.weights.owners_fused import ExpertRoute, engine_eps, owned_fused, route_for
from megatron_gspo.weights.owners_home import HomePath, home_fused
from megatron_gspo.weights.pipeline import SendPipeline
from megatron_gspo.weights.stream import (
    Bucket,
    StreamStats,
    hf_tensors,
    is_sender,
    iter_buckets,
    model_buckets,
)
from megatron_gspo.weights.transports import (
    DiskTransport,
    DistributedTransport,
    TensorTransport,
    Transport,
    _end_session,
)
from megatron_gspo.weights.verify import WeightSyncError, verification_due, verify_engines

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SyncReport:
    """What one `push` did (identical on every rank)."""

    version: int
    seconds: float = 0.0
    verified: bool = False
    stats: StreamStats = field(default_factory=StreamStats)
    bytes_by_rank: list[int] = field(default_factory=list)
    """`weights.senders=owners`: bytes each global rank sent (empty with one sender)."""

    @property
    def gb_per_s(self) -> float:
        return self.stats.bytes_sent / 1e9 / max(self.seconds, 1e-9)


def engine_tp_sizes(engines: Sequence[WeightReceiver]) -> list[int]:
    """The distinct TP sizes of the engines a sync reaches (`WeightReceiver.engine_tp_sizes`)."""
    return sorted({tp for engine in engines for tp in engine.engine_tp_sizes()} or {1})


def _num_experts(bridge: Any) -> int:
    """Routed experts per MoE layer from the bridge's HF config; 0 when it has none (the
    checksums then hold a layer's expert members until the push ends)."""
    try:
        hf = hf_io.hf_config_of(bridge)
    except AttributeError:
        return 0
    return layout.num_experts(hf) or 0


def _model_layout(bridge: Any, engine_ep_size: int) -> EngineLayout | None:
    """The model's shape for SGLang's own layout, for one TP rank (the receiver applies each
    engine's TP size); None when the bridge has no HF config."""
    try:
        hf = hf_io.hf_config_of(bridge)
    except AttributeError:
        return None
    return EngineLayout.of(hf, 1, engine_ep_size)


def _with_last(buckets: Iterator[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Yield (bucket, is_last) with one bucket of lookahead."""
    prev = None
    for b in buckets:
        if prev is not None:
            yield prev, False
        prev = b
    if prev is not None:
        yield prev, True


class WeightSync:
    """Owns the transport, the version counter and the checks; see the module docstring."""

    def __init__(
        self,
        bridge: Any,
        engines: WeightReceiver | Sequence[WeightReceiver],
        config: WeightSyncConfig | None = None,
        *,
        initial_version: int = 0,
        send_engines: Sequence[WeightReceiver] | None = None,
    ) -> None:
        """engines: on rank 0 every engine (sessions, versions, checks); elsewhere none.
        send_engines: with `weights.senders=owners`, the engines this rank sends its tensors to
        on every rank (its node's for `tensor`, all for `distributed`); default `engines`."""
        self.bridge = bridge
        self.engines = [engines] if isinstance(engines, WeightReceiver) else list(engines)
        self.send_engines = self.engines if send_engines is None else list(send_engines)
        self.config = config or WeightSyncConfig()
        self.version = initial_version
        self.sender = is_sender(self.config.sender_rank)
        self.model_layout = _model_layout(bridge, self.config.engine_ep_size)
        self.layout = self._resolve_layout()
        """"hf" or "engine": how this sync names and cuts what it pushes (`weights.layout`)."""
        self.transport: Transport | None = self._make_transport() if self.sender else None
        self._ready = False
        self._verified = False  # until a push was verified, every push is (another model?)
        self._namings: frozenset[str] | None = None
        """What the engines' checksums are named in (learnt at the first verified push)."""
        self.local_stats = StreamStats()
        """What this rank's last export received (`push` returns the sender's stats)."""
        self._owner_transport: Transport | None = None
        """This rank's transport as one of several senders (`weights.senders=owners`)."""
        self._owner_ready = False
        self._told_fallback = False
        self._told_slices = False
        self._home = HomePath()  # colocated: each engine rank fed from its own GPU

    @property
    def _tx(self) -> Transport:
        """The transport (the sender rank's only)."""
        assert self.transport is not None, "only the sender rank has a transport"
        return self.transport

    def _make_transport(self) -> Transport:
        cfg = self.config
        if cfg.transport == "tensor":
            sglang = self.layout == "engine"
            return TensorTransport(self.engines, layout=self.model_layout if sglang else None)
        if cfg.transport == "distributed":
            return DistributedTransport(
                self.engines,
                master_address=cfg.master_address,
                master_port=cfg.master_port,
                group_name=cfg.group_name,
                backend=cfg.backend,
                timeout_s=cfg.timeout_s,
            )
        qcfg = None
        if cfg.fp8:
            qcfg = fp8_lib.quantization_config_for(hf_io.hf_config_of(self.bridge))
        return DiskTransport(
            self.engines,
            root=Path(cfg.disk_dir or "."),
            hf_config=hf_io.hf_config_of(self.bridge),
            source_dir=hf_io.hf_source_dir(self.bridge),
            dtype=torch.bfloat16 if cfg.fp8 else cfg.torch_dtype,
            quantization_config=qcfg,
            keep=cfg.disk_keep,
        )

    def _send_on_cpu(self) -> bool:
        # Disk writes and gloo need host tensors; colocated IPC and nccl want device tensors.
        if not torch.cuda.is_available():
            return True
        return self.config.transport == "disk" or (
            self.config.transport == "distributed" and self.config.backend == "gloo"
        )

    def push(self, model: list[torch.nn.Module]) -> SyncReport:
        """Send the current weights as version `self.version + 1` (collective: every rank)."""
        cfg = self.config
        self.version += 1
        version = str(self.version)
        report = SyncReport(version=self.version)
        # The first push is always verified: an engine serving another model must not train.
        verify = verification_due(self.version, cfg.verify_every, verified_before=self._verified)
        error: BaseException | None = None
        start = time.perf_counter()
        prepared = False
        if cfg.senders == "owners":
            rejoined, error, self._namings = owners_lib.prepare(
                self.engines, self.send_engines, self.sender, cfg.transport, self._namings
            )
            prepared = True
            verify = verify or (cfg.verify_every > 0 and rejoined)
            return self._push_owners(model, report, verify, start, error)
        try:
            if self.sender and not self._ready:
                self._tx.setup()
                self._ready = True
            if self.sender and cfg.transport != "distributed" and not prepared:
                joining = [j for engine in self.engines for j in engine.prepare_sync()]
                # An engine that re-joins (restarted, or back from a hang) serves only once a
                # verified push reached it, whatever the schedule.
                verify = verify or (cfg.verify_every > 0 and bool(joining))
            if self.sender:
                self._tx.begin(version)
        except BaseException as e:  # noqa: BLE001 - reported on every rank below
            error = e
        sent_sums = self._checksums() if verify and self.sender else None
        stats = report.stats
        stats.add_seconds("begin", time.perf_counter() - start)
        buckets = model_buckets(
            self.bridge,
            model,
            bucket_bytes=cfg.bucket_bytes,
            sender_rank=cfg.sender_rank,
            cpu=self._send_on_cpu(),
            dtype=cfg.torch_dtype,
            use_fp8=cfg.fp8,
            fp8_check=cfg.fp8_check,
            experts_to_first=cfg.experts_to_first,
            expert_batch_bytes=self._expert_batch_bytes(),
            layout=self.layout,
            num_experts=_num_experts(self.bridge),
            grouped=cfg.grouped_export == "auto",
            stats=stats,
        )
        # Checksums and sends run on a worker thread while the next bucket is exported here.
        pipe = None
        if self.sender and error is None and self.transport is not None:
            pipe = SendPipeline(self.transport, sums=sent_sums, stats=stats, overlap=cfg.overlap)
        for bucket, last in _with_last(buckets):
            if pipe is not None:
                pipe.submit(bucket, version=version, last=last)
            # else keep iterating: the other ranks are inside the same collectives
        if pipe is not None:
            pipe.close()
            error = pipe.error
        if error is None and stats.error is not None:
            error = WeightSyncError(f"export stopped: {stats.error}")
        if self.sender and error is None:
            try:
                t0 = time.perf_counter()
                self._tx.finish(version)
                t1 = time.perf_counter()
                stats.add_seconds("finish", t1 - t0)
                self._conclude(version, sent_sums, report, stats)
            except BaseException as e:  # noqa: BLE001
                error = e
        if self.sender and error is not None and self.transport is not None:
            self.transport.abort()
        report.seconds = time.perf_counter() - start
        self.local_stats = report.stats
        outcome = self._agree(report, error)
        self._verified = self._verified or outcome.verified
        return outcome

    def _push_owners(
        self,
        model: list[torch.nn.Module],
        report: SyncReport,
        verify: bool,
        start: float,
        error: BaseException | None,
    ) -> SyncReport:
        """`push` with every rank sending what it holds (`weights.owners`); rank 0 opens the
        session, waits for every sender's last bucket, then closes it and stamps the version."""
        cfg, stats, version = self.config, report.stats, str(self.version)
        own = stats  # this rank's own export (rank 0's report gets every sender's, merged)
        grid = owners_lib.SenderGrid.gather(
            per_node=cfg.transport == "tensor",
            sending=bool(self.send_engines),
            engine_eps=engine_eps(self.model_layout, engine_tp_sizes(self.send_engines))
            if self.send_engines
            else frozenset(),
            slices=self._send_slices(verify),
        )
        problem = owners_lib.grid_problem(grid)  # the same on every rank: all stop here
        if problem is not None:
            return self._agree(report, error or WeightSyncError(problem))
        route = self._owner_route(grid, verify)  # SGLang's own layout from every sender
        home = self._home.plan(grid, route, self.send_engines, log=self.sender)
        if self.sender and error is None:
            try:
                for engine in self.engines:
                    engine.begin_weight_update()
            except BaseException as e:  # noqa: BLE001 - reported on every rank below
                error = e
        began = bool(dist.broadcast(error is None))  # no sender writes outside a session
        stats.add_seconds("begin", time.perf_counter() - start)
        mine: BaseException | None = None
        if self._owner_transport is None:
            self._owner_transport = owners_lib.sender_transport(cfg, self.send_engines)
        if isinstance(self._owner_transport, TensorTransport):
            self._owner_transport.layout = self.model_layout if route is not None else None
            self._owner_transport.engines = list(home.receivers if home else self.send_engines)
        if began and self.send_engines and not self._owner_ready:
            try:
                self._owner_transport.setup()
                self._owner_ready = True
            except BaseException as e:  # noqa: BLE001 - gathered to rank 0 below
                mine = e
        # Each sender hashes what it sent in the engines' naming: SGLang's fused per-rank
        # names when it sends SGLang's layout (`route`); otherwise HF names only, and pushes
        # verified against fused names go through one sender per scope (all members of a
        # fused parameter in one place).
        spread = route is not None or not verify or self._namings == frozenset({"hf"})
        keep = True
        sums: EngineChecksums | RankChecksums
        tensors: Iterator[tuple[str, Sendable]]
        if route is not None:
            assert self.model_layout is not None  # `_owner_route` checked it
            sums = RankChecksums(
                self.model_layout,
                engine_tp_sizes(self.send_engines),
                namings=self._namings or frozenset({"hf", "sglang"}),
                device=cfg.resolved_engine_device(),
            )
            g = cfg.grouped_export == "auto"  # experts straight from the Megatron parameters
            tensors = owned_fused(
                self.bridge, model, grid, route, cpu=self._send_on_cpu(), stats=stats, grouped=g,
                dtype=cfg.torch_dtype,
            ) if home is None else home_fused(
                self.bridge, model, grid, route, home, self.model_layout,
                cpu=self._send_on_cpu(), stats=stats, grouped=g,
            )  # fmt: skip
        elif spread:
            sums = EngineChecksums([EngineLayout(1, 1, 1, 1, 1, 0)], namings=frozenset({"hf"}))
            tensors = owners_lib.owned_tensors(
                self.bridge, model, grid, cpu=self._send_on_cpu(), stats=stats
            )
        else:
            keep = grid.scope()[0] == grid.rank
            sums = self._checksums(self.send_engines if keep else [])
            tensors = hf_tensors(
                self.bridge,
                model,
                cpu=self._send_on_cpu(),
                experts_to_first=cfg.experts_to_first,
                expert_batch_bytes=self._expert_batch_bytes(),
            )
        buckets = iter_buckets(
            tensors,
            keep=keep,
            bucket_bytes=cfg.bucket_bytes,
            dtype=cfg.torch_dtype,
            use_fp8=cfg.fp8,
            fp8_check=cfg.fp8_check,
            stats=stats,
            count_seen=route is None,  # owned_fused counts what the bridge exported
        )
        pipe = None
        if began and mine is None and self.send_engines:
            pipe = SendPipeline(
                self._owner_transport,
                sums=sums if verify else None,
                stats=stats,
                overlap=cfg.overlap,
            )
        for bucket, last in _with_last(buckets):
            if pipe is not None:
                pipe.submit(bucket, version=version, last=last)
        if pipe is not None:
            pipe.close()
            mine = mine or pipe.error
        if mine is None and stats.error is not None:
            mine = WeightSyncError(f"export stopped: {stats.error}")
        t0 = time.perf_counter()
        sent = owners_lib.SentChecksums.of(sums, engine_tp_sizes(self.send_engines), keep)
        senders = owners_lib.gather_outcomes(
            mine, sent if verify else None, stats, self.send_engines
        )
        if self.sender:
            error = error or owners_lib.first_error(senders)
            report.stats = stats = owners_lib.merged_stats([o[2] for o in senders])
            report.bytes_by_rank = [o[2].bytes_sent for o in senders]
            for one in senders:
                owners_lib.adopt_dropped(self.engines, one[3])
            stats.add_seconds("gather", time.perf_counter() - t0)
        if self.sender and error is None:
            try:
                t1 = time.perf_counter()
                # Every sender's last bucket is in: only now is the version stamped.
                _end_session(self.engines, version)
                t2 = time.perf_counter()
                stats.add_seconds("finish", t2 - t1)
                merged = owners_lib.merged_checksums(o[1] for o in senders) if verify else None
                self._conclude(version, merged, report, stats)
            except BaseException as e:  # noqa: BLE001
                error = e
        if self.sender and error is not None and began:
            owners_lib.abort(self.engines)
        report.seconds = time.perf_counter() - start
        self.local_stats = own
        outcome = self._agree(report, error)
        self._verified = self._verified or outcome.verified
        return outcome

    def _owner_route(self, grid: owners_lib.SenderGrid, verify: bool) -> ExpertRoute | None:
        """How every sender sends SGLang's own layout, or None: HF names, said once in the
        log (rank 0) when it is not for want of asking (`weights.layout=hf`)."""
        route, why = route_for(self.layout, self.model_layout, grid)
        if route is None and why and self.sender and not self._told_fallback:
            self._told_fallback = True
            logger.warning("weights.senders=owners sends HF names, not SGLang's layout: %s", why)
        if route is not None and grid.all_take_slices():
            route = replace(route, slices=True)
        elif (
            route is not None
            and route.peers > 1
            and not verify
            and self.config.expert_slices == "auto"
            and self.sender
            and not self._told_slices
        ):  # the engines that hold the push back (a gather per expert parameter), once
            slow = [r for r, (s, t) in enumerate(zip(grid.sending, grid.slices)) if s and not t]
            if slow:
                self._told_slices = True
                logger.warning(
                    "weights.expert_slices=auto: the engines of rank(s) %s do not load expert "
                    "slices (SGLang started without --custom-weight-loader %s); every rank's "
                    "experts are gathered first", slow, LOADER,
                )  # fmt: skip
        return route

    def _send_slices(self, verify: bool) -> bool:
        """Whether this rank's engines may get expert slices in this push
        (`weights.expert_slices`: auto, an unverified push, engines that load them)."""
        if self.config.expert_slices != "auto" or verify or not self.send_engines:
            return False
        if self.layout != "engine":  # HF names: nothing to slice, no engine asked
            return False
        return all(e.takes_expert_slices() for e in self.send_engines)

    def _expert_batch_bytes(self) -> int:
        """Bytes EP rank 0 receives per batched expert gather (about one bucket; 0: the
        bridge's per-tensor gathers)."""
        cfg = self.config
        return cfg.bucket_bytes if cfg.batch_expert_gathers and cfg.experts_to_first else 0

    def _checksums(self, engines: Sequence[WeightReceiver] | None = None) -> EngineChecksums:
        """What the sender predicts `engines` (default: this rank's `engines` on the sender)
        report."""
        if engines is None:
            engines = self.engines if self.sender else []
        tps = engine_tp_sizes(engines) if engines else []
        kw: dict[str, Any] = {"namings": self._namings} if self._namings else {}
        # SGLang's own hash on the engines' device (sha256 on CPU, Triton on CUDA).
        kw["device"] = self.config.resolved_engine_device()
        if tps == [1] and self.model_layout is not None and self.layout == "engine":
            one_rank = engine_layout(self.model_layout, 1)  # its heads cut qkv_proj
            return EngineChecksums([one_rank], **kw)
        if tps == [1]:  # nothing is sharded: only the expert count (when the bridge has it)
            return EngineChecksums([EngineLayout(1, 1, 1, 1, 1, _num_experts(self.bridge))], **kw)
        hf = hf_io.hf_config_of(self.bridge) if tps else None
        ep = self.config.engine_ep_size
        return EngineChecksums([EngineLayout.of(hf, tp, ep if tp > 1 else 1) for tp in tps], **kw)

    def _resolve_layout(self) -> str:
        layout = self.config.resolved_layout
        if layout == "engine" and self.model_layout is None:
            if self.config.layout == "engine":
                raise WeightSyncError(
                    "weights.layout=engine needs the model's HF config (head counts) from the "
                    "bridge, which has none; set weights.layout=hf"
                )
            return "hf"  # auto: without the model's shape, HF names
        return layout

    def _conclude(
        self,
        version: str,
        sums: EngineChecksums | owners_lib.SentChecksums | None,
        report: SyncReport,
        stats: StreamStats,
    ) -> None:
        """After the last bucket, on the sender: verify what was sent (`sums`, None: not this
        push), check the version the engines report, commit it on every engine."""
        t = time.perf_counter()
        if sums is not None:
            self._verify(sums)
            report.verified = True
            stats.add_seconds("verify", time.perf_counter() - t)
        if self.config.check_version:
            self._check_version(version)
        for engine in self.engines:
            engine.commit_sync(version)

    def _verify(self, sent: EngineChecksums | owners_lib.SentChecksums) -> None:
        self._namings = verify_engines(self.engines, sent, verify_names=self.config.verify_names)

    def _check_version(self, version: str) -> None:
        for engine in self.engines:
            for engine_id, served in engine.weight_version().items():
                if served != version:
                    raise WeightSyncError(
                        f"engine {engine_id} serves weight version {served!r} after a sync "
                        f"to {version!r}"
                    )

    def _agree(self, report: SyncReport, error: BaseException | None) -> SyncReport:
        """Broadcast the sender's outcome so every rank returns or raises the same way."""
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            payload = [(report, None if error is None else (type(error).__name__, str(error)))]
            src = self.config.sender_rank
            torch.distributed.broadcast_object_list(payload, src=src)
            report, err = payload[0]
            if err is not None and error is None:
                kind, msg = err
                if kind == "NoEnginesLeft":  # every rank stops the same way (train checkpoints)
                    raise NoEnginesLeft(msg)
                cls = WeightIntegrityError if kind == "WeightIntegrityError" else WeightSyncError
                raise cls(f"weight sync v{report.version} failed on rank {src}: {msg}")
        if error is not None:
            if isinstance(error, WeightIntegrityError | WeightSyncError | NoEnginesLeft):
                raise error
            raise WeightSyncError(f"weight sync v{report.version} failed: {error}") from error
        return report

    def close(self) -> None:
        """Release the transport (leave process groups). Call on every rank."""
        if self.transport is not None and self._ready:
            self.transport.close()
        if self._owner_transport is not None and self._owner_ready:
            self._owner_transport.close()
        self._ready = self._owner_ready = False
