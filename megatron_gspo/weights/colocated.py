"""Colocated memory order: the trainer frees the GPU before the engines take it back.

When trainer ranks and engines share GPUs (`rollout.launch.colocated`), one step ends with

    policy.update  ->  resume_engines (every rank)  ->  sync.push (CUDA-IPC buckets)

and `resume_engines` fixes the order of the hand-over by construction:

1. every rank returns its cached, now unused blocks (the update's activations and gradients
   in flight) to the driver: `dist.release_device_memory()` (ipc_collect + empty_cache);
2. a barrier: no engine reclaims memory while a rank on its GPU still caches it;
3. rank 0 (the one that talks to the engines) calls `engine.resume_memory()`.

During the push, `TensorTransport` keeps each CUDA-IPC bucket referenced until every engine
has answered `update_weights_from_tensor`, then releases it the same way, so the next bucket's
`torch.cat` cannot reuse its memory while SGLang may still read from it (SGLang answers before
its copies from a bucket are done; blocks it still holds stay in torch's IPC limbo until
`ipc_collect` finds them released).
"""

from __future__ import annotations

from megatron_gspo import dist
from megatron_gspo.engines.protocols import MemoryControl


def resume_engines(engine: MemoryControl | None, *, colocated: bool) -> None:
    """After the update, before the weight push (call on every rank; `engine` on rank 0 only,
    None elsewhere). A no-op unless `colocated`."""
    if not colocated:
        return
    dist.release_device_memory()
    dist.barrier()  # every rank's cache is back with the driver before an engine reclaims it
    if engine is not None:
        engine.resume_memory()
