"""The embedded CPU engine's command line: `python -m megatron_gspo.engines.embedded.cli
--model-path DIR --port P` serves `EmbeddedServer` (see `server.py`) until killed."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence

import torch

from megatron_gspo.engines.embedded.server import EmbeddedServer
from megatron_gspo.engines.routed_experts import SERVER_FLAG


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m megatron_gspo.engines.embedded.cli --model-path DIR --port P`."""
    args = parser().parse_args(argv)
    torch.set_num_threads(args.num_threads)
    # CPU tensors sent by /update_weights_from_tensor come from an unrelated process.
    torch.multiprocessing.set_sharing_strategy("file_system")
    logging.basicConfig(level=logging.INFO)
    EmbeddedServer(
        args.model_path,
        args.port,
        weight_version=args.weight_version,
        return_original_logprob=args.return_original_logprob,
        api_key=args.api_key,
        enable_return_routed_experts=args.enable_return_routed_experts,
        quantization=args.quantization,
    ).serve_forever()


def parser() -> argparse.ArgumentParser:
    """The command line of `main` (tests parse launch commands with it)."""
    p = argparse.ArgumentParser(
        description="the embedded CPU engine (SGLang's HTTP server, a CPU model)"
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", choices=["127.0.0.1"])
    p.add_argument("--weight-version", default="default")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--api-key", default=None, help="bearer token every request must carry")
    p.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="emulate block-FP8 inference (e4m3 128x128 weights, per-token-group activations)",
    )
    p.add_argument(
        "--return-original-logprob",
        action="store_true",
        default=os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0") in ("1", "true"),
        help="T=1 log-probs, like SGLANG_RETURN_ORIGINAL_LOGPROB=1",
    )
    p.add_argument(
        SERVER_FLAG,
        action="store_true",
        help="honour return_routed_experts (as SGLang's flag; routing replay, a study control)",
    )
    return p


if __name__ == "__main__":
    main()
