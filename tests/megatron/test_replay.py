"""Routing Replay (`rl.routing_replay`, a study control) on megatron-core's routers.

The engine (the embedded engine's `HFPolicy`, serving checkpoint B: A with noise on the router
weights) generates responses and returns the experts it routed each token to. The trainer's
model holds checkpoint A, so left to itself it routes many (token, layer) pairs differently.
Under replay, at every layout:
  * what megatron-core's routers chose (their routing maps) equals the engine's returned
    experts, per layer, per token (prompt tokens included);
  * the log-probs equal a Hugging Face forward of checkpoint A whose routers are forced
    to the engine's experts (an independent implementation of "route as the engine did");
  * the routing flip rate across an update (A -> B) is 0, against > 0 without replay, and
    `Policy.update` (built with rl.routing_replay=true) logs 0.
Switch off (a model built without RouterReplay): the routes change nothing, bit for bit.
"""

from __future__ import annotations

import types

import pytest
import torch

from megatron_gspo.data.tiny_model import save_tiny_hf_checkpoint
from megatron_gspo.testing.harness import spawn_ranks
from tests.megatron import replay_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LAYOUTS = {"tp2-sp": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}
"""Layouts that change which tokens and layers a router sees: TP with sequence parallelism
(a slice of the tokens), PP (a share of the layers), CP (a zig-zag shard of each sequence)."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from safetensors.torch import load_file, save_file

    from megatron_gspo.engines.embedded.model import HFPolicy

    root = tmp_path_factory.mktemp("replay")
    hf_a = save_tiny_hf_checkpoint(root / "a", seed=0)
    hf_b = save_tiny_hf_checkpoint(root / "b", seed=0)
    weights = load_file(f"{hf_b}/model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w += 0.5 * w.std() * torch.randn(w.shape, generator=g)
    save_file(weights, f"{hf_b}/model.safetensors", metadata={"format": "pt"})
    engine = HFPolicy(hf_b)
    data = []
    for i in range(6):
        prompt = torch.randint(3, 128, (2 + i % 3,), generator=g).tolist()
        sp = types.SimpleNamespace(
            sampling_seed=i, stop_token_ids=None, ignore_eos=True, max_new_tokens=4 + 2 * i,
            temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
        )  # fmt: skip
        out = engine.generate(prompt, sp, return_routed_experts=True)
        data.append(dict(prompt_ids=prompt, response_ids=out.output_ids, routes=out.routed_experts))
    return {"a": str(hf_a), "b": str(hf_b), "data": data}


def _forced_hf_logprobs(path: str, data: list[dict]) -> dict[int, torch.Tensor]:
    """fp32 HF forward of `path` (its grouped expert GEMM takes no float64) whose routers take
    the given experts (Qwen3-MoE: softmax over all experts, kept at the forced ones,
    renormalised), per response token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    forced: dict[str, torch.Tensor] = {}

    def gate_forward(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        idx = forced["idx"][:, self.layer]
        top = torch.softmax(logits, dim=-1).gather(1, idx)
        return logits, top / top.sum(-1, keepdim=True), idx

    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        gate.layer = i
        gate.forward = types.MethodType(gate_forward, gate)
    out = {}
    with torch.no_grad():
        for sid, d in enumerate(data):
            ids = d["prompt_ids"] + d["response_ids"]
            k = d["routes"].shape[-1]
            last = torch.arange(k).expand(1, d["routes"].shape[1], k)  # the unrouted last token
            forced["idx"] = torch.cat([d["routes"].long(), last])
            logits = model(torch.tensor([ids])).logits[0]
            p = len(d["prompt_ids"])
            logp = torch.log_softmax(logits[p - 1 : len(ids) - 1], -1)
            out[sid] = logp.gather(1, torch.tensor(d["response_ids"])[:, None])[:, 0]
    return out


@pytest.fixture(scope="module")
def forced_hf(setup: dict) -> dict[int, torch.Tensor]:
    return _forced_hf_logprobs(setup["a"], setup["data"])


@pytest.fixture(scope="module")
def results(setup: dict) -> list[dict]:
    return spawn_ranks(replay_ranks.main, 2, setup["a"], setup["b"], setup["data"], LAYOUTS)


def test_engine_routes_cover_prompt_and_response(setup: dict) -> None:
    for d in setup["data"]:
        assert d["routes"].shape == (len(d["prompt_ids"]) + len(d["response_ids"]) - 1, 2, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replayed_routing_equals_the_engines(name: str, results: list[dict], setup: dict) -> None:
    real = 2 * sum(len(d["prompt_ids"]) + len(d["response_ids"]) - 1 for d in setup["data"])
    bad = sum(r[name]["replayed"][0] for r in results)
    compared = sum(r[name]["replayed"][1] for r in results)
    own_bad = sum(r[name]["own"][0] for r in results)
    print(f"[replay] {name}: replayed {bad}/{compared} differ; own routing {own_bad} differ")
    assert compared >= real  # every routed (token, layer) seen by some rank (TP/CP: duplicates)
    assert bad == 0
    assert own_bad > 0.05 * compared  # the check can fail: the model's own routes differ


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replayed_logprobs_match_forced_hf(
    name: str, results: list[dict], forced_hf: dict[int, torch.Tensor]
) -> None:
    for r in results:
        got = r[name]["logp_replayed"]
        for sid, want in forced_hf.items():
            torch.testing.assert_close(torch.tensor(got[sid]), want, atol=5e-5, rtol=0)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flip_rate_is_zero_under_replay(name: str, results: list[dict]) -> None:
    for r in results:
        assert r[name]["flip_replayed"]["moe/routing_flip_rate"] == 0.0
        assert r[name]["flip_replayed"]["moe/routed_token_layers"] > 0
        assert r[name]["flip_own"]["moe/routing_flip_rate"] > 0.05
    print(f"[replay] {name}: flip rate A->B {results[0][name]['flip_own']} without replay")


def test_switch_off_changes_nothing(results: list[dict]) -> None:
    for r in results:
        first = r[next(iter(LAYOUTS))]
        assert first["plain_replay_routers"] == 0
        assert first["neutral_max_diff"] == 0.0


def test_policy_update_replays_and_logs_zero_flips(results: list[dict]) -> None:
    """Through `Policy.build` / `Policy.update` (rl.routing_replay=true): the routers carry
    RouterReplay, the update trains (finite loss) and the drift probe logs 0 flips."""
    for r in results:
        got = r["policy"]
        assert got["replay_routers"] > 0
        m = got["metrics"]
        assert m["moe/routing_flip_rate"] == 0.0 and m["moe/routed_token_layers"] > 0
        assert m["train/skipped_updates"] == 0.0 and torch.isfinite(torch.tensor(m["loss"]))
