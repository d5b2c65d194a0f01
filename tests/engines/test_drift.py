"""Route-table drift guard: fails if the pinned SGLang changes a route, a method, a request
field or a response field this bridge relies on (re-check the bridge, then update the pins)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from megatron_gspo.engines import wire as proto
from megatron_gspo.engines.types import SGLANG_SAMPLING_KEYS

PINNED_SGLANG = "0.5.23"


@pytest.fixture(scope="module")
def sglang_routes() -> dict[str, set[str]]:
    from sglang.srt.entrypoints.http_server import app

    routes: dict[str, set[str]] = {}
    for r in app.routes:
        if hasattr(r, "methods"):
            routes.setdefault(r.path, set()).update(r.methods)
    return routes


def test_pinned_version():
    from sglang.version import __version__

    assert __version__ == PINNED_SGLANG, "new SGLang: re-read the notes, then move the pin"


def test_routes_and_methods_exist(sglang_routes):
    for path, (methods, _) in proto.ROUTES.items():
        assert path in sglang_routes, f"SGLang dropped {path}"
        assert set(methods) <= sglang_routes[path], (path, sglang_routes[path])


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {f.name for f in msgspec.structs.fields(cls)}


def test_request_fields_exist():
    from sglang.srt.managers import io_struct

    for path, (_, cls_name) in proto.ROUTES.items():
        if cls_name is not None:
            assert cls_name in proto.FIELDS_SENT, f"{path}: list the fields sent as {cls_name}"
    for cls_name, fields in proto.FIELDS_SENT.items():
        cls = getattr(io_struct, cls_name)
        missing = set(fields) - _fields(cls)
        assert not missing, f"{cls_name} lost {missing}"


def test_sampling_param_keys_exist():
    from sglang.srt.sampling.sampling_params import SamplingParams

    assert set(SGLANG_SAMPLING_KEYS) <= _fields(SamplingParams)


def test_response_fields_exist():
    from sglang.api.v1.api_types import GenerateMetaInfo, GenerateResponse

    assert {"output_ids", "meta_info"} <= _fields(GenerateResponse)
    read = {"id", "finish_reason", "output_token_logprobs", "weight_version", "prompt_tokens"}
    assert read <= _fields(GenerateMetaInfo)


def test_weight_update_session_messages():
    """The messages the embedded engine copies (and users grep for) are still SGLang's."""
    import inspect

    from sglang.srt.managers.scheduler_components import weight_updater

    src = inspect.getsource(weight_updater)
    for msg in (
        "must run between",
        "a weight-update session is already open",
        "no weight-update session is open; call begin_weight_update() first",
        "Weights were updated, but the cache was not flushed because",
    ):
        assert msg in src, msg


def test_drift_check_can_fail(sglang_routes):
    assert "/update_weights_from_tensor_v2" not in sglang_routes
    assert "no_such_field" not in _fields(
        __import__("sglang.srt.managers.io_struct", fromlist=["x"]).GenerateReqInput
    )
