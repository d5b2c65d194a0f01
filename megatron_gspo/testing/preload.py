"""What the ranks of `testing.harness.spawn_ranks` fork from: imported once by the
multiprocessing forkserver (torch, megatron-core, megatron-bridge with our import patches), so
a multi-rank test launch does not pay ~9 s of imports per rank on 2 cores.

Only imports happen here: no process group, no device, no thread that a fork could not copy
(a test asserts the forkserver is still single-threaded in Python after it)."""

from __future__ import annotations

import contextlib
import io

# Imports that fail here are retried (and reported) by the rank that needs them.
with contextlib.suppress(Exception):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import logging

        logging.disable(logging.WARNING)  # megatron-bridge logs a traceback per missing extra
        try:
            import torch  # noqa: F401

            from megatron_gspo.patches.bridge import apply_bridge_imports

            apply_bridge_imports()
            import megatron.core.models.gpt  # noqa: F401
            from megatron.bridge import AutoBridge  # noqa: F401  (and the Qwen bridges)
        finally:
            logging.disable(logging.NOTSET)
