"""Our `--custom-weight-loader` for SGLang 0.5.23: `load_format="direct"` plus expert slices.

SGLang's `direct` loader (`weight_updater._model_load_weights_direct`) copies whole parameters
only, so a stacked expert parameter (`<mlp>.experts.w13_weight` [E_l, 2I, H], `w2_weight`
[E_l, H, I]) must leave the trainer from ONE sender: when an engine rank's experts are spread
over k trainer EP ranks, k - 1 of them first send theirs to one peer (the only communication
of an owners push, and at 2 GB on CPU most of its time). SGLang takes a custom loader by
import path for `update_weights_from_tensor` (`--custom-weight-loader PATH`, then
`load_format=PATH`; `weight_updater.update_weights_from_tensor` calls it with the model and
the rank's `(name, tensor)` list). This one loads what `direct` loads, and also a name
`<param>@experts=<i>`: the tensor's rows are the parameter's local experts i, i + 1, ... (dim
0), so every trainer rank sends its own experts straight into place.

This module runs inside SGLang's scheduler processes (the engine's interpreter): at import it
needs only the standard library (the trainer's planner imports it too), and in a call SGLang's
own `default_weight_loader`. The engine launcher (`launch.engine_command`) passes
`--custom-weight-loader LOADER`; a client sends slices only to engines whose `/server_info`
lists it (`client_weights.takes_expert_slices`).

Shape legend: E_l experts local to an engine rank, k experts in one slice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner imports this module (engines.launch) without torch
    import torch

LOADER = "megatron_gspo.engines.sglang_loader.load_direct_or_slices"
"""The import path SGLang gets (`--custom-weight-loader`) and requests name (`load_format`)."""

_SEP = "@experts="


def slice_name(param: str, first: int) -> str:
    """The name that sends rows `first`, `first + 1`, ... (dim 0) of SGLang parameter `param`."""
    if first < 0:
        raise ValueError(f"{param}: a slice cannot start at expert {first}")
    return f"{param}{_SEP}{first}"


def split_slice_name(name: str) -> tuple[str, int | None]:
    """`(param, first expert)` of a slice name; `(name, None)` for a whole parameter."""
    param, sep, first = name.partition(_SEP)
    if not sep:
        return name, None
    if not first.isdigit():
        raise ValueError(f"{name}: the expert index after {_SEP!r} is not a number")
    return param, int(first)


def is_slice_name(name: str) -> bool:
    return _SEP in name


def load_direct_or_slices(
    model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Load each tensor as SGLang's `direct` does (its own `default_weight_loader` into the
    parameter of that name), or a slice `<param>@experts=<i>` [k, ...] into that parameter's
    rows i .. i + k - 1. Raises naming the tensor on an unknown name or a shape that does not
    fit (SGLang then reports the update failed)."""
    params = dict(model.named_parameters())
    for name, tensor in named_tensors:
        param_name, first = split_slice_name(name)
        param = params.get(param_name)
        if param is None:
            raise KeyError(f"{name}: the model has no parameter {param_name!r}")
        if first is None:
            from sglang.srt.model_loader.weight_utils import default_weight_loader

            default_weight_loader(param, tensor)
            continue
        dst = param.data
        if dst.dim() == 0 or first + tensor.shape[0] > dst.shape[0]:
            raise ValueError(
                f"{name}: {tensor.shape[0]} experts from {first} do not fit "
                f"{param_name} {tuple(dst.shape)}"
            )
        dst = dst[first : first + tensor.shape[0]]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"{name}: shape {tuple(tensor.shape)} does not fit {param_name} {tuple(dst.shape)}"
            )
        dst.copy_(tensor)


__all__ = ["LOADER", "is_slice_name", "load_direct_or_slices", "slice_name", "split_slice_name"]
