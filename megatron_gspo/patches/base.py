"""The `Patch` record shared by every runtime fix."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field


class PatchError(RuntimeError):
    """An upstream library no longer matches what a patch assumes: review the patch."""


@dataclass(kw_only=True)
class Patch:
    """One runtime fix to an upstream library."""

    name: str
    """Short identifier, e.g. `mcore-rng-tracker-cpu`."""
    package: str
    """Distribution the fix targets, e.g. `megatron-core`."""
    versions: tuple[str, ...]
    """Upstream versions the fix was written and tested against (exact)."""
    why: str
    """The exact failure without the fix."""
    remove_when: str
    """The condition under which the fix can be deleted."""
    apply_fn: Callable[[], None]
    """Installs the fix. Must be idempotent."""
    check_fn: Callable[[], None]
    """Raises `PatchError` when the upstream code no longer matches the fix's assumption."""
    applied: bool = field(default=False, init=False)

    def installed_version(self) -> str:
        return importlib.metadata.version(self.package)

    def check(self) -> None:
        version = self.installed_version()
        if version not in self.versions:
            raise PatchError(
                f"patch {self.name!r} was tested with {self.package} {self.versions}, found "
                f"{version}: re-run tests/patches and update the patch or constraints.txt"
            )
        self.check_fn()

    def apply(self) -> None:
        if not self.applied:
            self.check()
            self.apply_fn()
            self.applied = True

    def describe(self) -> str:
        return (
            f"### {self.name} ({self.package} {', '.join(self.versions)})\n"
            f"- why: {self.why}\n- remove when: {self.remove_when}\n"
        )
