"""`cpu_runtime.without_cuda_mode`: the wrapped iterator runs without `CudaToCpuMode`, the
caller between items keeps it, and the items are the iterator's own (single process)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from megatron_gspo.patches import cpu_runtime


@pytest.fixture(autouse=True)
def _no_mode_from_earlier_tests() -> Iterator[None]:
    # A test that ran earlier in this process may have applied the CPU runtime, which leaves its
    # own CudaToCpuMode pushed for good; the test's mode would then sit on top of it.
    with contextlib.ExitStack() as stack:
        while torch.overrides._get_current_function_mode() is not None:
            stack.enter_context(torch.overrides._pop_mode_temporarily())
        yield


def _producer(seen: list[bool]) -> Iterator[torch.Tensor]:
    for i in range(3):
        # What the producer sees: is the CPU mode active while it makes this item?
        seen.append(
            isinstance(torch.overrides._get_current_function_mode(), cpu_runtime.CudaToCpuMode)
        )
        yield torch.arange(4.0) + i


def test_items_are_made_without_the_mode_and_the_caller_keeps_it(monkeypatch) -> None:
    mode = cpu_runtime.CudaToCpuMode()
    monkeypatch.setitem(cpu_runtime._state, "mode", mode)
    seen: list[bool] = []
    caller: list[bool] = []
    with mode:
        got = []
        for item in cpu_runtime.without_cuda_mode(_producer(seen)):
            caller.append(torch.overrides._get_current_function_mode() is mode)
            # the caller still gets CUDA placements rewritten to the CPU
            caller.append(torch.ones(1, device="cuda").device.type == "cpu")
            got.append(item)
        after = torch.overrides._get_current_function_mode() is mode
    assert seen == [False, False, False]
    assert all(caller) and after
    # the same items as the plain iterator (independent reference: no wrapper, no mode)
    ref = list(_producer([]))
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_without_the_mode_installed_it_passes_through(monkeypatch) -> None:
    monkeypatch.setitem(cpu_runtime._state, "mode", None)
    seen: list[bool] = []
    assert [int(t[0]) for t in cpu_runtime.without_cuda_mode(_producer(seen))] == [0, 1, 2]
