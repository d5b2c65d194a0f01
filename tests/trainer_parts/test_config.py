"""Config: YAML loading, typed overrides, did-you-mean, and every validation message."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_gspo.config import (
    Config,
    ConfigError,
    GspoConfig,
    ParallelConfig,
    config_from_dict,
    dump_config,
    field_docs,
    load_config,
    parse_cli,
)

BASE = ["model.hf_path=/m", "data.train_path=/d.jsonl"]


def cfg(*overrides: str) -> Config:
    return load_config(None, [*BASE, *overrides])


def err(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        cfg(*overrides)
    return str(e.value)


def test_yaml_file_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        yaml.safe_dump(
            {
                "model": {"hf_path": "/tiny", "dtype": "fp32"},
                "data": {"train_path": "/t.jsonl"},
                "parallel": {"ep": 2},
                "gspo": {"group_size": 4, "eps_high": "5e-4"},  # YAML 1.1 reads 5e-4 as a str
            }
        )
    )
    c = load_config(
        p, ["parallel.ep=4", "optim.lr=2e-6", "rollout.engines=[http://a:1, http://b:2]"]
    )
    assert c.model.hf_path == "/tiny" and c.model.dtype == "fp32"
    assert c.parallel.ep == 4  # override beats the file
    assert c.gspo.group_size == 4 and c.gspo.eps_high == 5e-4 and isinstance(c.gspo.eps_high, float)
    assert c.optim.lr == 2e-6
    assert c.rollout.engines == ["http://a:1", "http://b:2"] and not c.rollout.embedded


def test_override_types():
    c = cfg(
        "logging.tensorboard=false",
        "train.steps=7",
        "gspo.mismatch_cap=3",  # an int literal into a float field
        "model.hf_path=007",  # a string field keeps its text
        "checkpoint.dir=null",
        "logging.wandb_project=123",
    )
    assert c.logging.tensorboard is False and c.train.steps == 7
    assert c.gspo.mismatch_cap == 3.0 and isinstance(c.gspo.mismatch_cap, float)
    assert c.model.hf_path == "007" and c.checkpoint.dir is None
    assert c.logging.wandb_project == "123"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=1.5", "train.steps=1.5 must be an integer; change train.steps"),
        ("train.steps=yes", "train.steps=True must be an integer"),
        ("logging.jsonl=3", "logging.jsonl=3 must be true or false"),
        ("optim.lr=fast", "optim.lr='fast' must be a number"),
        ("rollout.engines=foo", "rollout.engines='foo' is not one of"),
        ("gspo.algorithm=ppo", "gspo.algorithm='ppo' is not one of gspo | gspo_token | grpo"),
    ],
)
def test_type_errors(override, expected):
    assert expected in err(override)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("gspo.eps_hgih=1", "did you mean 'gspo.eps_high'?"),
        ("modle.hf_path=x", "did you mean 'model'?"),
        ("rollout.temprature=0.5", "did you mean 'rollout.temperature'?"),
    ],
)
def test_unknown_override_key_suggests(override, suggestion):
    msg = err(override)
    assert "unknown config key" in msg and suggestion in msg


def test_unknown_yaml_key_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model: {hf_path: /m}\ndata: {train_path: /d}\noptim: {weight_decy: 0.1}\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'optim.weight_decy'.*'optim.weight_decay'"
    ):
        load_config(p)


def test_missing_required_and_bad_override_syntax():
    with pytest.raises(ConfigError, match="missing required config key 'model'"):
        load_config(None, ["data.train_path=/d"])
    with pytest.raises(ConfigError, match="missing required config key 'data.train_path'"):
        load_config(None, ["model.hf_path=/m", "data.seed=1"])
    with pytest.raises(ConfigError, match="not of the form"):
        cfg("gspo.group_size")
    with pytest.raises(ConfigError, match="gspo.group_size is not a section"):
        cfg("gspo.group_size.x=1")


def test_eps_defaults_per_algorithm():
    assert (cfg().gspo.eps_low, cfg().gspo.eps_high) == (3e-4, 4e-4)
    assert (cfg("gspo.algorithm=gspo_token").gspo.eps_low,) == (3e-4,)
    g = cfg("gspo.algorithm=grpo").gspo
    assert (g.eps_low, g.eps_high) == (0.2, 0.27)
    g = cfg("gspo.algorithm=grpo", "gspo.eps_high=0.28").gspo
    assert (g.eps_low, g.eps_high) == (0.2, 0.28)


# Every __post_init__ message: (overrides, fragment that must name the key to change).
VALIDATION = [
    (["model.hf_path="], "set model.hf_path"),
    (["model.moe_aux_loss_coef=-1"], "change model.moe_aux_loss_coef"),
    (["parallel.tp=0"], "parallel.tp=0 must be >= 1; change parallel.tp"),
    (["parallel.etp=0"], "change parallel.etp"),
    (["parallel.vpp=2"], "set parallel.pp > 1"),
    (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    (["parallel.tp=2", "parallel.ep=2"], "set parallel.sequence_parallel=true"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0; change optim.lr"),
    (["optim.adam_beta2=1.0"], "change optim.adam_beta2"),
    (["optim.clip_grad=-1"], "change optim.clip_grad"),
    (["optim.min_lr=1"], "optim.min_lr=1.0 exceeds optim.lr"),
    (["optim.warmup_steps=-1"], "change optim.warmup_steps"),
    (["gspo.eps_low=1.5"], "change gspo.eps_low"),
    (["gspo.eps_high=-0.1"], "change gspo.eps_high"),
    (["gspo.group_size=1"], "change gspo.group_size"),
    (["gspo.prompts_per_rollout=0"], "change gspo.prompts_per_rollout"),
    (
        ["gspo.prompts_per_rollout=3", "gspo.group_size=3", "gspo.mini_batches_per_rollout=4"],
        "change gspo.mini_batches_per_rollout",
    ),
    (["gspo.mismatch_correction=token"], "set gspo.pi_old=recompute"),
    (
        ["gspo.mismatch_correction=token", "gspo.pi_old=recompute"],
        "use gspo.mismatch_correction=sequence or gspo.algorithm=gspo_token",
    ),
    (["gspo.log_ratio_clamp=0"], "change gspo.log_ratio_clamp"),
    (["gspo.mismatch_cap=0"], "change gspo.mismatch_cap"),
    (["rollout.engines=[]"], "rollout.engines is an empty list"),
    (["rollout.engines=[localhost:3000]"], "is not an http(s) URL; fix rollout.engines"),
    (["rollout.router_url=http://r:1"], "set rollout.engines to their URLs"),
    (["rollout.engines=[http://a:1]", "rollout.router_url=r:1"], "fix rollout.router_url"),
    (["rollout.precision=fp8"], "set rollout.precision=bf16"),
    (["rollout.temperature=0"], "change rollout.temperature"),
    (["rollout.top_p=1.5"], "change rollout.top_p"),
    (["rollout.top_k=0"], "change rollout.top_k"),
    (["rollout.max_new_tokens=0"], "change rollout.max_new_tokens"),
    (["rollout.bucket_mb=0"], "change rollout.bucket_mb"),
    (["data.train_path="], "set data.train_path"),
    (["data.max_prompt_tokens=0"], "change data.max_prompt_tokens"),
    (["reward.kind=mymodule"], "change reward.kind"),
    (["reward.kind=:f"], "change reward.kind"),
    (["reward.num_workers=-1"], "change reward.num_workers"),
    (["reward.timeout_s=0"], "change reward.timeout_s"),
    (["checkpoint.save_every=-1"], "change checkpoint.save_every"),
    (["checkpoint.resume=true"], "checkpoint.resume=true needs a directory; set checkpoint.dir"),
    (["checkpoint.export_hf_at_end=true"], "set checkpoint.dir"),
    (["checkpoint.save_every=5"], "set checkpoint.dir"),
    (["checkpoint.dir=/c", "checkpoint.keep_last=0"], "change checkpoint.keep_last"),
    (["logging.log_every=0"], "change logging.log_every"),
    (["train.steps=0"], "change train.steps"),
    (
        ["rollout.max_new_tokens=512", "train.micro_batch_tokens=512"],
        "raise train.micro_batch_tokens or lower rollout.max_new_tokens",
    ),
]


@pytest.mark.parametrize("overrides, fragment", VALIDATION, ids=[v[0][-1] for v in VALIDATION])
def test_validation_messages(overrides, fragment):
    assert fragment in err(*overrides)


def test_valid_edge_cases_pass():
    cfg("parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true")
    cfg("reward.kind=my.pkg.rewards:score", "reward.num_workers=0")
    cfg("rollout.top_k=20", "rollout.top_p=1.0", "checkpoint.dir=/c", "checkpoint.resume=true")
    cfg("gspo.eps_low=0", "gspo.eps_high=0")  # allowed by the loss: a zero-width band
    cfg("gspo.pi_old=recompute", "gspo.mismatch_correction=token", "gspo.algorithm=grpo")


WORLD = dict(num_layers=4, num_heads=4, num_kv_heads=2, num_experts=8)


@pytest.mark.parametrize(
    "layout, world, dp",
    [
        (dict(), 1, 1),
        (dict(ep=2), 2, 2),
        (dict(tp=2, ep=2, etp=1, sequence_parallel=True), 2, 1),  # experts on the TP ranks
        (dict(tp=2, ep=4, etp=1, sequence_parallel=True), 4, 2),
        (dict(pp=2, vpp=2, ep=2), 4, 2),
        (dict(cp=2, ep=4, dp=2), 4, 2),  # EP spans CP ranks too
    ],
)
def test_validate_world_ok(layout, world, dp):
    assert ParallelConfig(**layout).validate_world(world, **WORLD) == dp


@pytest.mark.parametrize(
    "layout, world, model, fragment",
    [
        (dict(tp=2), 3, {}, "world size 3 is not divisible by parallel.tp*pp*cp"),
        (dict(dp=4), 2, {}, "change parallel.dp (to 2 or null)"),
        (
            dict(ep=3),
            3,
            {},
            "parallel.ep=3 does not divide model num_experts=8; change parallel.ep",
        ),
        (dict(ep=4), 2, {}, "does not divide dp*cp*tp = 2*1*1 = 2"),
        (
            dict(tp=2, etp=2, ep=2, sequence_parallel=True),
            2,
            {},
            "parallel.etp*ep = 2*2 = 4 does not divide dp*cp*tp",
        ),
        (dict(tp=8), 8, {}, "does not divide model num_attention_heads=4; change parallel.tp"),
        (dict(tp=4), 4, {}, "does not divide model num_key_value_heads=2"),
        (dict(pp=3), 3, {}, "parallel.pp*vpp = 3*1 = 3 does not divide model num_layers=4"),
        (dict(pp=2, vpp=4), 2, {}, "parallel.pp*vpp = 2*4 = 8 does not divide"),
        (dict(ep=2), 2, {"num_experts": None}, "need an MoE model"),
    ],
)
def test_validate_world_errors(layout, world, model, fragment):
    with pytest.raises(ConfigError) as e:
        ParallelConfig(**layout).validate_world(world, **{**WORLD, **model})
    assert fragment in str(e.value)


def test_dump_roundtrip(tmp_path):
    c = cfg("gspo.algorithm=grpo", "rollout.engines=[http://x:1]", "parallel.ep=2")
    text = dump_config(c, tmp_path / "out.yaml")
    assert load_config(tmp_path / "out.yaml") == c
    assert config_from_dict(yaml.safe_load(text)) == c
    assert c.to_dict()["gspo"]["eps_low"] == 0.2


def test_every_field_has_a_docstring():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
                walk(f.type)
        return docs

    walk(Config)
    for f in dataclasses.fields(Config):
        walk(type(getattr(cfg(), f.name)))
    assert "3e-4" in field_docs(GspoConfig)["eps_low"]


def test_parse_cli(tmp_path):
    c, args = parse_cli(
        ["--set", BASE[0], "--set", BASE[1], "--set", "checkpoint.dir=/c", "--resume"]
    )
    assert c.checkpoint.resume is True and args.config is None


@pytest.mark.parametrize("algorithm", ["gspo", "gspo_token", "grpo"])
def test_gspo_section_agrees_with_the_loss_config(algorithm):
    # Guards against the two defaults tables drifting apart (the loss owns its own copy).
    from megatron_gspo.algo.losses import PolicyLossConfig

    g = cfg(f"gspo.algorithm={algorithm}").gspo
    loss = PolicyLossConfig(kind=algorithm)
    assert (g.eps_low, g.eps_high, g.log_ratio_clamp) == (
        loss.eps_low,
        loss.eps_high,
        loss.log_ratio_clamp,
    )
    mode = "sequence" if algorithm == "gspo" else "token"
    g = cfg(
        f"gspo.algorithm={algorithm}", "gspo.pi_old=recompute", f"gspo.mismatch_correction={mode}"
    ).gspo
    PolicyLossConfig(
        kind=g.algorithm,
        eps_low=g.eps_low,
        eps_high=g.eps_high,
        log_ratio_clamp=g.log_ratio_clamp,
        tis_mode=g.mismatch_correction,
        tis_cap=g.mismatch_cap,
    )


def test_layout_from_config_carries_every_layout_field() -> None:
    import dataclasses

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.megatron.model import Layout

    p = ParallelConfig(tp=2, pp=2, vpp=3, cp=2, ep=4, etp=1, sequence_parallel=True)
    layout = Layout.from_config(p)
    shared = {f.name for f in dataclasses.fields(Layout)}
    assert shared <= {f.name for f in dataclasses.fields(ParallelConfig)}  # dp is config-only
    for name in shared:
        assert getattr(layout, name) == getattr(p, name), name
