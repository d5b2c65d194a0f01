"""The embedded CPU engine: SGLang's own HTTP server with a CPU model behind it.

SGLang's FastAPI `app` (`sglang.srt.entrypoints.http_server`) is served unchanged, so routes,
body parsing, the `/generate` contract gate, status codes and error envelopes are SGLang's.
Only its `TokenizerManager` is replaced by `EmbeddedTokenizerManager`
(`tokenizer_manager.py`: the model, generation and SGLang's control-plane semantics).

Run as a server process:

    python -m megatron_gspo.engines.embedded.cli --model-path DIR --port 30000

or in-process (tests): `EmbeddedServer(model_path, port).start()` ... `.stop()`. With
`--api-key` (`api_key=`) every request needs `Authorization: Bearer <key>` and gets SGLang's
401 without it, decided by SGLang's own `decide_request_auth` per route (health probes open).
Several in-process servers may run at once: SGLang's app reads one global tokenizer manager, so that
global is a proxy that dispatches to the manager of the server the request arrived on.
"""

from __future__ import annotations

import contextvars
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_gspo.dist import free_port
from megatron_gspo.engines.embedded.model import HFPolicy
from megatron_gspo.engines.embedded.tokenizer_manager import EmbeddedTokenizerManager
from megatron_gspo.engines.sglang_loader import LOADER

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from starlette.types import Receive, Scope, Send

_CURRENT_TM: contextvars.ContextVar[EmbeddedTokenizerManager] = contextvars.ContextVar(
    "embedded_tokenizer_manager"
)


class _DispatchingTokenizerManager:
    """SGLang's global tokenizer manager slot: forwards to the manager of the current server."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_CURRENT_TM.get(), name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(_CURRENT_TM.get(), name, value)


_INSTALL_LOCK = threading.Lock()
_INSTALLED: dict[str, Any] = {}


def _install_sglang_app(model_path: str) -> FastAPI:
    """Publish SGLang's server config and global state once per process; return its app."""
    with _INSTALL_LOCK:
        if "app" in _INSTALLED:
            return _INSTALLED["app"]
        from sglang.srt.entrypoints import http_server
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        # custom_weight_loader: this engine loads expert slices, as SGLang with our loader.
        args = ServerArgs(
            model_path=model_path,
            device="cpu",
            skip_tokenizer_init=True,
            custom_weight_loader=[LOADER],
        )
        args.resolve_once()
        publish(args, role="tokenizer")
        http_server.set_global_state(
            http_server._GlobalState(
                tokenizer_manager=_DispatchingTokenizerManager(),
                template_manager=None,
                scheduler_info={},
            )
        )
        _INSTALLED.update(app=http_server.app, server_args=args)
        return http_server.app


def _authorized(app: FastAPI, scope: Scope, api_key: str) -> bool:
    """SGLang's decision for this request (its `add_api_key_middleware` logic), per server:
    the app is shared by every in-process server, so the key cannot be app middleware."""
    from sglang.srt.utils.auth import _get_auth_level_from_app_and_scope, decide_request_auth

    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    decision = decide_request_auth(
        method=scope["method"],
        path=scope["path"],
        authorization_header=headers.get("authorization"),
        api_key=api_key,
        admin_api_key=None,
        auth_level=_get_auth_level_from_app_and_scope(app, scope),
    )
    return decision.allowed


async def _unauthorized(scope: Scope, receive: Receive, send: Send) -> None:
    """SGLang's 401 body (its middleware sends the same JSON)."""
    from starlette.responses import JSONResponse

    await JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)


class EmbeddedServer:
    """One embedded engine: SGLang's app + `EmbeddedTokenizerManager` on 127.0.0.1:port."""

    def __init__(
        self,
        model_path: str | Path,
        port: int | None = None,
        *,
        weight_version: str = "default",
        return_original_logprob: bool = False,
        api_key: str | None = None,
        enable_return_routed_experts: bool = False,
        quantization: str | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.api_key = api_key
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy = HFPolicy(
            self.model_path,
            return_original_logprob=return_original_logprob,
            quantization=quantization,
        )
        app = _install_sglang_app(self.model_path)
        self.tm = EmbeddedTokenizerManager(
            self.policy, _INSTALLED["server_args"], weight_version=weight_version
        )
        tm = self.tm
        tm.enable_return_routed_experts = enable_return_routed_experts

        async def asgi(scope, receive, send):
            if api_key and scope["type"] == "http" and not _authorized(app, scope, api_key):
                await _unauthorized(scope, receive, send)
                return
            token = _CURRENT_TM.set(tm)
            try:
                await app(scope, receive, send)
            finally:
                _CURRENT_TM.reset(token)

        self._asgi = asgi
        self._server: uvicorn.Server | None = None  # once started (uvicorn loads lazily)
        self._thread: threading.Thread | None = None

    def _config(self):
        import uvicorn

        return uvicorn.Config(
            self._asgi, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning"
        )

    def start(self, timeout_s: float = 120.0) -> EmbeddedServer:
        """Serve in a daemon thread; returns once the port accepts connections (`timeout_s`
        bounds a hang, not the start-up: uvicorn's start shares this process's share of a
        loaded machine)."""
        import uvicorn

        self._server = uvicorn.Server(self._config())
        self._thread = threading.Thread(target=self._server.run, daemon=True, name="embedded")
        self._thread.start()
        deadline = time.time() + timeout_s
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"embedded engine on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Stop serving and join the thread (a server thread left running would serve into
        whatever runs next in this process)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=120)
        self.tm._pool.shutdown(wait=False, cancel_futures=True)

    def serve_forever(self) -> None:
        """Serve in the calling thread (the subprocess entry point)."""
        import uvicorn

        uvicorn.Server(self._config()).run()
