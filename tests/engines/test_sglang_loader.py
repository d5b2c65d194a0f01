"""Our SGLang `--custom-weight-loader` (`engines.sglang_loader`): expert slices from several
senders. The references: the whole stacked parameter as `Fuser` assembles it from HF names
(what SGLang's `direct` load holds), and SGLang's own argument parser for the launch flag."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engines.launch import LaunchConfig, engine_command
from megatron_gspo.engines.sglang_loader import (
    LOADER,
    load_direct_or_slices,
    slice_name,
    split_slice_name,
)
from megatron_gspo.engines.weight_fused import unfuse
from megatron_gspo.engines.weight_layout import (
    FusedParts,
    engine_layout,
    fused_stream,
    member_names,
    rank_pieces,
)
from megatron_gspo.engines.weight_shards import EngineLayout

E, INTER, H = 8, 6, 4  # experts, expert intermediate size, hidden
W13 = "model.layers.0.mlp.experts.w13_weight"
W2 = "model.layers.0.mlp.experts.w2_weight"


def _experts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for m, shape in (("gate", (INTER, H)), ("up", (INTER, H)), ("down", (H, INTER))):
            name = f"model.layers.0.mlp.experts.{e}.{m}_proj.weight"
            out[name] = torch.randn(*shape, generator=g)
    return out


def _layout(tp: int = 1, ep: int = 1) -> EngineLayout:
    return engine_layout(EngineLayout(tp, ep, 4, 2, 8, E), tp)


def _share(group: str, experts: range, weights: dict[str, torch.Tensor]) -> FusedParts:
    """One trainer EP rank's members of `group`: its experts only."""
    per = 2 if group == W13 else 1
    keys = [(e, i) for e in experts for i in range(per)]
    names = member_names(group, keys)
    return FusedParts(group, [(n, weights[n]) for n in names])


class _Model(torch.nn.Module):
    """An engine rank's two stacked expert parameters (zeros), of the rank's shapes."""

    def __init__(self, n: int, w13: tuple[int, ...] = (), w2: tuple[int, ...] = ()) -> None:
        super().__init__()
        w13, w2 = w13 or (n, 2 * INTER, H), w2 or (n, H, INTER)
        self.w13 = torch.nn.Parameter(torch.zeros(w13), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(w2), requires_grad=False)

    def named_parameters(self, *a, **k):  # SGLang's names
        yield W13, self.w13
        yield W2, self.w2


@pytest.mark.parametrize(
    ("trainer_ep", "tp", "ep"), [(2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 2, 2), (8, 2, 2)]
)
def test_slices_from_every_holder_load_the_whole_parameter(trainer_ep: int, tp: int, ep: int):
    """k = trainer EP / engine EP holders per engine rank each send their experts (no gather):
    each piece is named a slice at its first local expert, and loading every holder's pieces
    with the loader gives each engine rank bitwise the parameter the one-sender push gives it.
    """
    weights = _experts()
    lay = _layout(tp, ep)
    whole = dict(fused_stream(list(weights.items()), num_experts=E))
    per = E // trainer_ep
    for r in range(tp):
        n_local = E // lay.ep_size
        shapes = [tuple(_rank_whole(g, whole[g], r, lay).shape) for g in (W13, W2)]
        model = _Model(n_local, *shapes)
        names = []
        for holder in range(trainer_ep):
            held = range(holder * per, (holder + 1) * per)
            items = [(g, _share(g, held, weights)) for g in (W13, W2)]
            for piece in rank_pieces(items, r, lay):
                t = torch.cat([s.reshape(-1) for s in piece.sources]).view(piece.shape)
                load_direct_or_slices(model, [(piece.name, t)])
                names.append(piece.name)
        assert all(split_slice_name(n)[1] is not None for n in names)
        assert len(names) == 2 * (n_local // per)  # every holder of the rank's experts, once
        for group, got in ((W13, model.w13), (W2, model.w2)):
            ref = _rank_whole(group, whole[group], r, lay)
            assert torch.equal(got.data, ref), (group, r)


def _rank_whole(group: str, t: torch.Tensor, r: int, lay: EngineLayout) -> torch.Tensor:
    from megatron_gspo.engines.weight_layout import rank_tensor

    part = rank_tensor(group, t, r, lay)
    assert part is not None
    return part[1]


def test_a_whole_set_of_experts_keeps_the_parameters_name():
    """One holder of all an engine rank's experts sends the whole parameter (SGLang's own
    `direct` name), never a slice."""
    weights = _experts()
    items = [(g, _share(g, range(E), weights)) for g in (W13, W2)]
    assert [p.name for p in rank_pieces(items, 0, _layout())] == [W13, W2]


def test_unfuse_names_a_slices_members_by_their_expert():
    """The embedded engine (HF names) unfuses a slice into the members it came from."""
    weights = _experts()
    share = _share(W13, range(4, 6), weights)
    (piece,) = rank_pieces([(W13, share)], 0, _layout())
    assert piece.name == slice_name(W13, 4)
    t = torch.cat([s.reshape(-1) for s in piece.sources]).view(piece.shape)
    got = unfuse(piece.name, t, _layout())
    assert [n for n, _ in got] == [n for n, _ in share.parts]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, share.parts, strict=True))
    with pytest.raises(ValueError, match="only stacked expert"):
        unfuse(slice_name("model.layers.0.self_attn.qkv_proj.weight", 0), t, _layout())


def test_the_loader_refuses_what_does_not_fit():
    model = _Model(4)
    with pytest.raises(ValueError, match="do not fit"):
        load_direct_or_slices(model, [(slice_name(W2, 3), torch.zeros(2, H, INTER))])
    with pytest.raises(ValueError, match="does not fit"):
        load_direct_or_slices(model, [(slice_name(W2, 0), torch.zeros(2, H, INTER + 1))])
    with pytest.raises(KeyError, match="no parameter"):
        load_direct_or_slices(model, [(slice_name("x.w2_weight", 0), torch.zeros(1, H, INTER))])
    with pytest.raises(ValueError, match="not a number"):
        split_slice_name(W2 + "@experts=a")
    assert torch.count_nonzero(model.w2) == 0  # nothing was written by a refused slice


def test_the_launcher_passes_our_loader_to_sglangs_parser():
    """SGLang's own parser reads our loader from the engine command, and a user's own
    `--custom-weight-loader` list keeps its entries with ours added."""
    from sglang.srt.server_args import prepare_server_args

    cfg = LaunchConfig(model_path="m", backend="sglang")
    args = prepare_server_args(engine_command(cfg, 0, python="python")[3:])
    assert args.custom_weight_loader == [LOADER]
    mine = LaunchConfig(
        model_path="m", backend="sglang", extra_args=["--custom-weight-loader", "my.mod.load"]
    )
    args = prepare_server_args(engine_command(mine, 0, python="python")[3:])
    assert sorted(args.custom_weight_loader) == sorted([LOADER, "my.mod.load"])


def test_engines_whose_interpreter_lacks_the_package_start_without_it(tmp_path):
    """The planner probes the engines' interpreter: one that cannot import this package gets
    no `--custom-weight-loader` (SGLang would fail the first sliced push at import), and the
    plan says so in a note, not a refusal."""
    import json
    import sys

    from megatron_gspo.config import load_config
    from megatron_gspo.plan.launch import launch_check

    fake = tmp_path / "python"
    modules = {"sglang": True, "sgl_kernel": True, "sglang_router": False}
    answer = {"python": str(fake), "nccl": {}, "modules": modules, "torch": None}
    fake.write_text(f"#!/bin/sh\necho '{json.dumps(answer)}'\n")
    fake.chmod(0o755)
    cfg = load_config("examples/tiny_moe_cpu.yaml")
    check = launch_check(cfg, engine_python=str(fake), rollout_nodes=0)
    assert not check.engine_loader and "cannot import megatron_gspo" in check.notes[0]
    assert not any("megatron_gspo" in p for p in check.problems)
    check = launch_check(cfg, engine_python=sys.executable, rollout_nodes=0)
    assert check.engine_loader and check.notes == []  # this checkout's interpreter finds it
    launch = LaunchConfig(model_path="m", backend="sglang")
    assert "--custom-weight-loader" not in engine_command(launch, 0, our_loader=False)
