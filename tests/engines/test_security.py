"""Security of what the trainer and its embedded engine accept (issue 15).

* Every HTTP route of the embedded engine but the health probes refuses a request without the
  api key (weight pushes, control and generation alike), listed from SGLang's app itself, so a
  route added upstream is covered without editing this file.
* Weight payloads (`/update_weights_from_tensor`) are unpickled by SGLang's allow-list
  unpickler: a payload whose unpickling would run a command is refused and the command never
  runs, both by `deserialize_named_tensors` and through the HTTP route.
* Engines listen on 127.0.0.1 unless configured otherwise.
* No file the project writes is read back with full unpickling (`weights_only=False`,
  `pickle.load`) anywhere in the package or tools/.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from megatron_gspo.engines.embedded.cli import parser
from megatron_gspo.engines.embedded.server import EmbeddedServer
from megatron_gspo.engines.launch import LaunchConfig, engine_command
from megatron_gspo.engines.wire import deserialize_named_tensors

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-for-tests"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")  # probes SGLang leaves open (its auth rule)


class _RunsACommand:
    """Unpickling this calls os.system (what a malicious weight payload would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def keyed(ckpt_a):
    srv = EmbeddedServer(ckpt_a, api_key=KEY).start()
    yield srv
    srv.stop()


def _request(url: str, method: str, key: str | None, body: bytes = b"{}") -> int:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body if method != "GET" else None, method=method)
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_every_route_but_health_needs_the_key(keyed) -> None:
    from megatron_gspo.engines.embedded.server import _INSTALLED

    routes = []
    for r in _INSTALLED["app"].routes:
        path, methods = getattr(r, "path", None), getattr(r, "methods", None) or set()
        if path and "{" not in path and not path.startswith(OPEN_PREFIXES):
            routes += [(path, m) for m in sorted(methods) if m in ("GET", "POST", "PUT")]
    weight_routes = {p for p, _ in routes if "weight" in p or "memory" in p}
    assert {  # the weight routes SGLang has today are among those checked
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    } <= weight_routes
    assert len(routes) > 20
    for path, method in routes:
        for key in (None, "wrong-key"):
            assert _request(keyed.url + path, method, key) == 401, (method, path, key)
    assert _request(keyed.url + "/health", "GET", None) == 200


def test_a_payload_that_runs_a_command_is_refused(tmp_path: Path, keyed) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps(_RunsACommand(marker))).decode()
    with pytest.raises(RuntimeError, match="Blocked unsafe global .*system"):
        deserialize_named_tensors(payload, "direct")
    assert not marker.exists()
    # The same payload through the engine's route, with the key: refused, nothing run.
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    post = lambda path, body: urllib.request.urlopen(  # noqa: E731
        urllib.request.Request(
            keyed.url + path, data=json.dumps(body).encode(), method="POST", headers=headers
        ),
        timeout=30,
    )
    post("/begin_weight_update", {})
    try:
        body = {"serialized_named_tensors": [payload], "load_format": "direct"}
        with pytest.raises(urllib.error.HTTPError) as e:
            post("/update_weights_from_tensor", body)
        assert e.value.code == 400 and "system" in e.value.read().decode()
    finally:
        post("/end_weight_update", {})
    assert not marker.exists()


def test_engines_listen_on_loopback_by_default(keyed, tmp_path: Path) -> None:
    cfg = LaunchConfig(model_path=str(tmp_path))
    assert cfg.host == "127.0.0.1" and cfg.engine_urls[0].startswith("http://127.0.0.1:")
    sglang = engine_command(LaunchConfig(model_path="m", backend="sglang"), 0, python="python")
    assert sglang[sglang.index("--host") + 1] == "127.0.0.1"
    embedded = engine_command(LaunchConfig(model_path="m", backend="embedded"), 0)
    assert parser().parse_args(embedded[3:]).host == "127.0.0.1"  # its only choice
    listening = [
        c.laddr
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == keyed.port
    ]
    assert [a.ip for a in listening] == ["127.0.0.1"]


def test_no_full_unpickling_of_files_we_write() -> None:
    """`torch.load` always with weights_only=True; no pickle.load(s) at all. The one exception,
    the test harness, reads results its own spawned ranks wrote into a private temp dir."""
    allowed = {"megatron_gspo/testing/harness.py"}
    bad = []
    for path in [*ROOT.glob("megatron_gspo/**/*.py"), *ROOT.glob("tools/**/*.py")]:
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        for m in re.finditer(r"torch\.load\((?:[^()]|\([^()]*\))*\)", text):
            if "weights_only=True" not in m.group(0) and rel not in allowed:
                bad.append(f"{rel}: {m.group(0)}")
        for m in re.finditer(r"pickle\.loads?\(|weights_only=False|Unpickler\(", text):
            if rel not in allowed:
                bad.append(f"{rel}: {m.group(0)}")
    assert bad == []
