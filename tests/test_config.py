"""Config: YAML loading, typed overrides, did-you-mean, and every validation message."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megatron_gspo.config import (
    Config,
    ConfigError,
    Layout,
    PolicyLossConfig,
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
                "rl": {"group_size": 4},
                "loss": {"eps_high": "5e-4"},  # YAML 1.1 reads 5e-4 as a str
            }
        )
    )
    c = load_config(
        p,
        [
            "parallel.ep=4",
            "optim.lr=2e-6",
            "rollout.launch=null",
            "rollout.client.engine_urls=[http://a:1, http://b:2]",
        ],
    )
    assert c.model.hf_path == "/tiny" and c.model.dtype == "fp32"
    assert c.parallel.ep == 4  # override beats the file
    assert c.rl.group_size == 4 and c.loss.eps_high == 5e-4 and isinstance(c.loss.eps_high, float)
    assert c.optim.lr == 2e-6
    assert c.rollout.client.engine_urls == ["http://a:1", "http://b:2"]
    assert not c.rollout.embedded and c.rollout.launch is None


def test_override_types():
    c = cfg(
        "logging.tensorboard=false",
        "train.steps=7",
        "loss.log_ratio_clamp=3",  # an int literal into a float field
        "model.hf_path=007",  # a string field keeps its text
        "checkpoint.dir=null",
        "logging.wandb_project=123",
    )
    assert c.logging.tensorboard is False and c.train.steps == 7
    assert c.loss.log_ratio_clamp == 3.0 and isinstance(c.loss.log_ratio_clamp, float)
    assert c.model.hf_path == "007" and c.checkpoint.dir is None
    assert c.logging.wandb_project == "123"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=1.5", "train.steps=1.5 must be an integer; change train.steps"),
        ("train.steps=yes", "train.steps=True must be an integer"),
        ("logging.jsonl=3", "logging.jsonl=3 must be true or false"),
        ("optim.lr=fast", "optim.lr='fast' must be a number"),
        ("rollout.launch.backend=foo", "rollout.launch.backend='foo' is not one of"),
        ("loss.kind=ppo", "loss.kind='ppo' is not one of gspo | gspo_token | grpo"),
    ],
)
def test_type_errors(override, expected):
    assert expected in err(override)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("loss.eps_hgih=1", "did you mean 'loss.eps_high'?"),
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
        cfg("rl.group_size")
    with pytest.raises(ConfigError, match="rl.group_size is not a section"):
        cfg("rl.group_size.x=1")


def test_eps_defaults_per_algorithm():
    assert (cfg().loss.eps_low, cfg().loss.eps_high) == (3e-4, 4e-4)
    assert (cfg("loss.kind=gspo_token").loss.eps_low,) == (3e-4,)
    g = cfg("loss.kind=grpo").loss
    assert (g.eps_low, g.eps_high) == (0.2, 0.27)
    g = cfg("loss.kind=grpo", "loss.eps_high=0.28").loss
    assert (g.eps_low, g.eps_high) == (0.2, 0.28)


# Every __post_init__ message: (overrides, fragment that must name the key to change).
VALIDATION = [
    (["model.hf_path="], "set model.hf_path"),
    (["model.moe_aux_loss_coef=-1"], "change model.moe_aux_loss_coef"),
    (["parallel.tp=0"], "parallel.tp=0 must be an integer >= 1; change parallel.tp"),
    (["parallel.etp=0"], "change parallel.etp"),
    (["parallel.vpp=2"], "set parallel.pp > 1"),
    (["parallel.sequence_parallel=true"], "needs parallel.tp > 1"),
    (
        ["parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=false"],
        "set parallel.sequence_parallel to true or null",
    ),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0; change optim.lr"),
    (["optim.adam_beta2=1.0"], "change optim.adam_beta2"),
    (["optim.clip_grad=-1"], "change optim.clip_grad"),
    (["optim.min_lr=1"], "optim.min_lr=1.0 exceeds optim.lr"),
    (["optim.warmup_steps=-1"], "change optim.warmup_steps"),
    (["train.steps=2", "optim.warmup_steps=8"], "must be below the run's 8 optimizer steps"),
    (["optim.sgd_momentum=1"], "change optim.sgd_momentum"),
    (["loss.eps_low=1.5"], "change loss.eps_low"),
    (["loss.eps_high=-0.1"], "loss.eps_high=-0.1 must be >= 0"),
    (["rl.group_size=1"], "change rl.group_size"),
    (["rl.prompts_per_rollout=0"], "change rl.prompts_per_rollout"),
    (
        ["rl.prompts_per_rollout=3", "rl.group_size=3", "rl.mini_batches_per_rollout=4"],
        "change rl.mini_batches_per_rollout",
    ),
    (["loss.kind=grpo", "loss.tis_mode=token"], "set rl.pi_old=recompute"),
    (
        ["loss.tis_mode=token", "rl.pi_old=recompute"],
        "use loss.tis_mode=sequence or loss.kind=gspo_token",
    ),
    (["loss.log_ratio_clamp=0"], "loss.log_ratio_clamp=0.0 must be > 0"),
    (["loss.tis_cap=0"], "loss.tis_cap=0.0 must be > 0"),
    (["loss.seq_mismatch_mask=[1.001,1.002]"], "change loss.seq_mismatch_mask"),
    (["loss.token_mismatch_mask=[0.5]"], "change loss.token_mismatch_mask"),
    (["rollout.launch=null"], "set exactly one of rollout.launch"),
    (["rollout.client.engine_urls=[http://a:1]"], "set exactly one of rollout.launch"),
    (
        ["rollout.launch=null", "rollout.client.engine_urls=[localhost:3000]"],
        "is not an http(s) URL",
    ),
    (["rollout.launch.num_engines=0"], "rollout.launch.num_engines=0 must be >= 1"),
    (["weights.fp8=true"], "set weights.fp8=false, rollout.launch.quantization=fp8 or"),
    (["rollout.launch.quantization=fp8"], "set weights.fp8=true or rollout.launch.quantization"),
    (["rollout.launch.quantization=int8"], "the embedded engine emulates fp8 only"),
    (
        [
            "rollout.launch.backend=sglang",
            "rollout.launch.device=cpu",
            "rollout.launch.colocated=true",
        ],
        "kills the CPU server; set rollout.launch.colocated=false",
    ),
    (["rollout.temperature=0"], "change rollout.temperature"),
    (["rollout.top_p=1.5"], "change rollout.top_p"),
    (["rollout.top_k=0"], "change rollout.top_k"),
    (["rollout.top_p=0.9"], "pi_old would not be the behaviour policy; set rollout.top_p=1"),
    (["rollout.top_k=20"], "pi_old would not be the behaviour policy; set rollout.top_k=-1"),
    (["rollout.max_continuation_retries=-1"], "change rollout.max_continuation_retries"),
    (["rollout.max_new_tokens=0"], "change rollout.max_new_tokens"),
    (["weights.bucket_mb=0"], "weights.bucket_mb=0.0 must be > 0"),
    (["train.max_bad_steps=0"], "change train.max_bad_steps"),
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
    cfg("reward.kind=my.pkg.rewards:score", "reward.num_workers=1")
    cfg("reward.kind=toy", "reward.num_workers=0")  # built-ins may run in-process
    cfg("rollout.top_k=-1", "rollout.top_p=1.0", "checkpoint.dir=/c", "checkpoint.resume=true")
    cfg("loss.eps_low=0", "loss.eps_high=0")  # allowed by the loss: a zero-width band
    cfg("rl.pi_old=recompute", "loss.tis_mode=token", "loss.kind=grpo")
    c = cfg("loss.seq_mismatch_mask=[0.999, 1.002]", "loss.token_mismatch_mask=[0.5, 2]")
    assert c.loss.seq_mismatch_mask == [0.999, 1.002] and c.loss.token_mismatch_mask == [0.5, 2.0]
    cfg("parallel.tp=2", "parallel.ep=2")  # sequence parallelism turns itself on
    c = cfg("weights.transport=disk", "logging.dir=/runs/x")
    assert c.weights.disk_dir == "/runs/x/weights" and c.rollout.launch.model_path == "/m"


def test_weights_dtype_follows_a_real_servers_dtype():
    """A real SGLang server casts received weights to its own dtype, so only its dtype can match
    its checksums; the embedded engine serves the trainer's, and explicit choices stay."""
    sglang = "rollout.launch.backend=sglang"
    assert cfg(sglang, "model.dtype=fp32").weights.dtype == "bfloat16"
    assert cfg(sglang, "rollout.launch.dtype=float16").weights.dtype == "float16"
    assert cfg(sglang, "rollout.launch.dtype=auto").weights.dtype is None  # unknown: trainer's
    assert cfg(sglang, "weights.dtype=float32").weights.dtype == "float32"
    assert cfg(sglang, "weights.fp8=true").weights.dtype is None  # fp8 picks per tensor
    assert cfg("model.dtype=fp32").weights.dtype is None  # embedded
    # the embedded engine holds fp32: a bf16 trainer sends its weights upcast (exact)
    assert cfg("model.dtype=bf16").weights.dtype == "float32"
    assert cfg("model.dtype=bf16", "weights.dtype=bfloat16").weights.dtype == "bfloat16"
    # the embedded FP8 emulation holds its unquantised tensors in fp32
    fp8 = cfg("rollout.launch.quantization=fp8", "weights.fp8=true")
    assert fp8.weights.dtype == "float32"
    # GPU colocated stays allowed; only the CPU server dies on release/resume
    cfg(sglang, "rollout.launch.colocated=true")
    assert cfg(sglang, "rollout.launch.dtype=half").weights.dtype == "float16"  # torch's alias
    assert cfg(sglang, "rollout.launch.dtype=float").weights.dtype == "float32"


def test_dtype_names_are_torchs_floating_dtypes():
    """The config checks dtype names without importing torch (the planner loads none): its
    table is torch's own floating-point dtypes, aliases mapped to their canonical names."""
    import torch

    from megatron_gspo.config_io import FLOAT_DTYPES

    floating = {
        name: str(dtype).removeprefix("torch.")
        for name in dir(torch)
        if isinstance(dtype := getattr(torch, name, None), torch.dtype) and dtype.is_floating_point
    }
    assert FLOAT_DTYPES == floating
    assert "weights.dtype='int8' is not a floating-point torch dtype" in err("weights.dtype=int8")
    assert cfg("weights.dtype=half").weights.torch_dtype is torch.float16


HF = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=8)


def hf(**changes):
    from types import SimpleNamespace

    return SimpleNamespace(**{**HF, **changes})


@pytest.mark.parametrize(
    "layout, world, dp",
    [
        (dict(), 1, 1),
        (dict(ep=2), 2, 2),
        (dict(tp=2, ep=2, etp=1, sequence_parallel=True), 2, 1),  # experts on the TP ranks
        (dict(tp=2, ep=4, etp=1), 4, 2),
        (dict(pp=2, vpp=2, ep=2), 4, 2),
        (dict(cp=2, ep=4, dp=2), 4, 2),  # EP spans CP ranks too
    ],
)
def test_validate_ok(layout, world, dp):
    assert Layout(**layout).validate(world, hf()) == dp


@pytest.mark.parametrize(
    "layout, world, model, fragment",
    [
        (dict(tp=2), 3, {}, "world size 3 is not divisible by tp*pp*cp"),
        (dict(dp=4), 2, {}, "change parallel.dp (to 2 or null)"),
        (
            dict(ep=3),
            3,
            {},
            "parallel.ep=3 does not divide the model's num_experts=8; change parallel.ep",
        ),
        (dict(ep=4), 2, {}, "does not divide dp*cp*tp = 2*1*1 = 2"),
        (
            dict(tp=2, etp=2, ep=2, sequence_parallel=True),
            2,
            {},
            "etp*ep = 2*2 = 4 does not divide dp*cp*tp",
        ),
        (
            dict(tp=8),
            8,
            {},
            "does not divide the model's num_attention_heads=4; change parallel.tp",
        ),
        (dict(tp=4), 4, {}, "does not divide the model's num_key_value_heads=2"),
        (dict(pp=3), 3, {}, "pp*vpp = 3*1 = 3 does not divide the model's num_hidden_layers=4"),
        (dict(pp=2, vpp=4), 2, {}, "pp*vpp = 2*4 = 8 does not divide"),
        (dict(ep=2), 2, {"num_experts": None}, "need an MoE model"),
    ],
)
def test_validate_errors(layout, world, model, fragment):
    with pytest.raises(ConfigError) as e:
        Layout(**layout).validate(world, hf(**model))
    assert fragment in str(e.value)


def test_validate_names_the_tools_flags():
    with pytest.raises(ConfigError, match="change --ep"):
        Layout(ep=3).validate(3, hf(), key="--")


def test_dump_roundtrip(tmp_path):
    c = cfg(
        "loss.kind=grpo",
        "rollout.launch=null",
        "rollout.client.engine_urls=[http://x:1]",
        "parallel.ep=2",
    )
    text = dump_config(c, tmp_path / "out.yaml")
    assert load_config(tmp_path / "out.yaml") == c
    assert config_from_dict(yaml.safe_load(text)) == c
    assert c.to_dict()["loss"]["eps_low"] == 0.2
    d = cfg("rollout.launch.extra_args=[--foo]")
    assert config_from_dict(yaml.safe_load(dump_config(d))) == d


def test_every_field_has_a_docstring():
    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
        return docs

    def walk_values(obj):
        walk(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk_values(value)

    walk_values(cfg())
    assert "3e-4" in field_docs(PolicyLossConfig)["eps_low"]


def test_parse_cli(tmp_path):
    c, args = parse_cli(
        ["--set", BASE[0], "--set", BASE[1], "--set", "checkpoint.dir=/c", "--resume"]
    )
    assert c.checkpoint.resume is True and args.config is None


def test_keys_listing_names_every_leaf_with_its_docstring(capsys):
    from megatron_gspo.config import _main

    _main(["--keys"])
    out = capsys.readouterr().out
    assert "optim.lr_schedule = 'constant'\n    After warmup: constant at optim.lr" in out
    assert "rollout.launch.backend = 'embedded'" in out and "weights.fp8 = False" in out


def test_engine_data_parallelism_needs_the_disk_transport():
    assert "set weights.transport=disk" in err("rollout.launch.dp_size=2")
    cfg("rollout.launch.dp_size=2", "weights.transport=disk")
