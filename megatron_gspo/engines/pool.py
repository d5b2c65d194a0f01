"""`EnginePool`: which of a client's engines generate and which receive weights.

An engine is in one of three states:

* live: it generates and receives every weight sync;
* dead: it failed a control call (a weight sync it missed part of leaves it with stale or mixed
  weights), or `dead_after_failures` generation requests in a row (connection refused, timeout,
  5xx, garbage). It gets no request at all: no generation, no control call, no weight sync.
  When the job launched it, a restart is asked for (`ServerGroup.restart_engine`, bounded by
  `rollout.launch.max_restarts`);
* joining: a dead engine that answers its health probe again (restarted, or back from a hang).
  It takes part in the next weight sync, which always carries the full weights and is always
  verified (`WeightSync` verifies every push an engine joins, whatever `weights.verify_every`),
  and becomes live only once that sync was verified (`commit`), so it never serves stale or
  initial weights.

Every drop, restart and return prints one line on stderr naming the URL and the reason. When
no engine is left (none live, none joining), `NoEnginesLeft` is raised.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence

from megatron_gspo.engines.protocols import NoEnginesLeft

RestartHook = Callable[[str, str], bool]
"""`hook(url, reason)` restarts a dropped engine; True when a restart was started."""


def _say(line: str) -> None:
    print(f"[rollout] {line}", file=sys.stderr, flush=True)


class EnginePool:
    """Health bookkeeping of one client's engines; see the module docstring."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        dead_after_failures: int,
        cooldown_s: float,
        restart: RestartHook | None = None,
    ) -> None:
        self.urls = list(urls)
        self.dead_after_failures = dead_after_failures
        self.cooldown_s = cooldown_s
        self.restart = restart
        self.dead: dict[str, str] = {}
        """URL -> why it was dropped."""
        self.joining: set[str] = set()
        self.failures: Counter = Counter()
        """Consecutive failed generation requests per URL (reset by a success)."""
        self.down_until: dict[str, float] = {}
        """Engines that failed rest until this time (kept across calls, so a failing engine is
        not re-tried by every later call's first request)."""
        self.restarts = 0

    # ---- who gets what ----------------------------------------------------------------------
    def live(self) -> list[str]:
        """Engines that generate."""
        return [u for u in self.urls if u not in self.dead and u not in self.joining]

    def control_targets(self) -> list[str]:
        """Engines that receive control calls and weight syncs (live and joining)."""
        return [u for u in self.urls if u not in self.dead]

    def require_live(self) -> list[str]:
        """The live engines; `NoEnginesLeft` when there are none."""
        live = self.live()
        if not live:
            raise NoEnginesLeft(self._none_left())
        return live

    def require_targets(self) -> list[str]:
        targets = self.control_targets()
        if not targets:
            raise NoEnginesLeft(self._none_left())
        return targets

    def _none_left(self) -> str:
        why = "; ".join(f"{u}: {r}" for u, r in self.dead.items())
        return f"no rollout engine left ({len(self.urls)} dropped: {why})"

    # ---- events -------------------------------------------------------------------------
    def succeeded(self, url: str) -> None:
        self.failures[url] = 0

    def failed(self, url: str, reason: str) -> None:
        """A generation request failed on `url`: rest it; drop it after too many in a row."""
        self.failures[url] += 1
        self.down_until[url] = time.monotonic() + self.cooldown_s
        if self.failures[url] >= self.dead_after_failures:
            self.drop(url, f"{self.failures[url]} failed requests in a row, last: {reason}")

    def drop(self, url: str, reason: str) -> None:
        """Stop sending anything to `url`; ask for a restart when the job launched it."""
        if url in self.dead:
            return
        self.dead[url] = reason
        self.joining.discard(url)
        left = len(self.control_targets())
        _say(f"engine {url} dropped: {reason} ({left} of {len(self.urls)} engines left)")
        if self.restart is not None and self.restart(url, reason):
            self.restarts += 1

    def probe_dead(self, healthy: Callable[[list[str]], set[str]]) -> list[str]:
        """Dead engines that `healthy` finds answering again join the next weight sync."""
        if not self.dead:
            return []
        back = sorted(healthy(list(self.dead)))
        for url in back:
            del self.dead[url]
            self.joining.add(url)
            self.failures[url] = 0
            self.down_until.pop(url, None)
            _say(f"engine {url} answers again: it gets the full weights before it generates")
        return back

    def commit(self, weight_version: str) -> list[str]:
        """The sync to `weight_version` was verified: joining engines serve again."""
        back = sorted(self.joining)
        self.joining.clear()
        for url in back:
            _say(f"engine {url} is back, serving weight version {weight_version}")
        return back
