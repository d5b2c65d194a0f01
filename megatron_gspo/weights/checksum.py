"""Per-tensor integrity check of a weight sync: sender and engine checksum the same bytes.

The checksum is the one SGLang's `/weights_checker` computes per tensor, with SGLang's own
function on the device the engines hold their weights on (`engines.wire.tensor_checksum`:
sha256 of the raw bytes for CPU engines, the Triton `gpu_tensor_hash` for CUDA ones;
`weights.engine_device`), so the trainer and every engine implementing
`RolloutEngine.weights_checksum()` agree bit for bit. `WeightSync` feeds it one bucket at a
time on its send thread, while the next bucket is exported (for CPU engines through
`host_views`: one device->host copy per bucket on GPU, none on CPU). It costs about one hash
per byte sent on each side, which is why `WeightSyncConfig.verify_every` thins it out
(docs/performance.md has the measured cost of the sha256 branch).

Engines report checksums of what they HOLD, in the dtype they hold it: the embedded engine
under HF names, a real SGLang server under its own fused parameter names (q/k/v, gate/up,
stacked experts), which `engines.weight_names.SGLangChecksums` reproduces from the tensors as sent.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_gspo.engines.weight_group import host_views
from megatron_gspo.engines.wire import tensor_checksum

__all__ = ["WeightIntegrityError", "checksums", "compare_checksums", "host_views"]


class WeightIntegrityError(RuntimeError):
    """A tensor the engine holds differs from the one the trainer sent (the name is in the text)."""


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """`{name: checksum}` of tensors as sent."""
    return {name: tensor_checksum(t) for name, t in named}


def compare_checksums(sent: dict[str, str], received: dict[str, str], engine: str = "") -> None:
    """Raise `WeightIntegrityError` naming every tensor that is missing or differs (first 5)."""
    where = f" on engine {engine}" if engine else ""
    bad = []
    for name, digest in sent.items():
        got = received.get(name)
        if got is None:
            bad.append(f"{name!r} was sent but is missing{where}")
        elif got != digest:
            bad.append(f"{name!r} differs{where}: sent {digest}, engine holds {got}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise WeightIntegrityError("weight sync checksum mismatch: " + "; ".join(bad[:5]) + more)
