"""torchrun's worker in a recipe rehearsal: `python -m megatron_gspo.train ARGS`, started while
the engines start.

    python -m torch.distributed.run ... -m tests.plan.rehearsal_rank GO_FILE ARGS...

The rank pays its imports (torch, megatron-core, megatron-bridge with our import patches: what
`testing.preload` imports for the multi-rank tests) while the engines import and load, then
waits for GO_FILE (the test writes it once every engine and the router answer their health
probes: the Slurm script's order) and runs the trainer's own entry point with ARGS. A rehearsal
artefact only: on a cluster the trainer starts after the health probes.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    go, args = sys.argv[1], sys.argv[2:]
    import megatron_gspo.testing.preload  # noqa: F401
    import megatron_gspo.train as train

    deadline = time.monotonic() + 900
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise SystemExit(f"rehearsal_rank: {go} never appeared")
        time.sleep(0.2)
    sys.argv = ["megatron_gspo.train", *args]
    train.cli()


if __name__ == "__main__":
    main()
