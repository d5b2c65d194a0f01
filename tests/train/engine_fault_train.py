"""`megatron_gspo.train` with planted engine faults (launched by test_engine_faults_e2e.py).

Step 2: engine 0 is SIGKILLed mid-rollout, as the step's first request to it is sent (the
others are in flight): that request meets a dead engine whatever the timing. (Killed after
the first answer instead, engine 0 had sometimes answered all its requests at once already,
under load, and nothing was re-sent.) Step 3: waits until the restarted engine 0 answers (so
that the sync after step 3 re-admits it). Step 5: both engines are SIGKILLed before
generating; engine 0 has used its restart, so no engine is left. After every weight sync the
engines' reported versions go to the file named by $MGSPO_TEST_VERSIONS.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from megatron_gspo.engines.client import SGLangClient
from megatron_gspo.rollout import experience as trainer
from megatron_gspo.weights.sync import WeightSync

_collect, _push, _request = trainer.Rollout.next_batch, WeightSync.push, SGLangClient._request
_calls = {"collect": 0}


def _collect_with_faults(self: trainer.Rollout) -> Any:
    _calls["collect"] += 1
    step, servers = _calls["collect"], self.servers
    if step == 2:
        engine0 = servers.cfg.engine_url(0)

        async def kill_before_it_answers(session, method, url, body=None):  # noqa: ANN001
            if url == f"{engine0}/generate" and not _calls.get("killed"):
                _calls["killed"] = 1
                servers.kill_engine(0)
                print("[test] killed engine 0 mid-rollout", file=sys.stderr, flush=True)
            return await _request(session, method, url, body)

        SGLangClient._request = staticmethod(kill_before_it_answers)
    elif step == 3:
        SGLangClient._request = staticmethod(_request)
        url = servers.cfg.engine_url(0)
        deadline = time.monotonic() + 180
        while not self.engine._healthy([url]) and time.monotonic() < deadline:
            time.sleep(0.5)
    elif step == 5:
        servers.kill_engine(0)
        servers.kill_engine(1)
    return _collect(self)


def _push_and_record(self: WeightSync, model: Any) -> Any:
    report = _push(self, model)
    if self.sender and self.engines:
        (client,) = self.engines
        row = {"version": report.version, "engines": client.weight_version()}
        with open(os.environ["MGSPO_TEST_VERSIONS"], "a") as f:
            f.write(json.dumps(row) + "\n")
    return report


if __name__ == "__main__":
    from megatron_gspo.train import cli

    trainer.Rollout.next_batch = _collect_with_faults
    WeightSync.push = _push_and_record
    cli()
