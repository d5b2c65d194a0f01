"""The parallel layout: one class for the trainer's config, the Megatron adapter, the conversion
tools and checkpoint metadata (plain Python; megatron-core's rules, checked before it runs), and
the model's HF config it is checked against (`HFConfig`: what the package reads of one, also in
engines/, plan/ and weights/).

    layout = Layout(tp=2, ep=4)
    dp = layout.validate(world_size=8, hf_config=AutoConfig.from_pretrained(path))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from megatron_gspo.config_io import ConfigError, require

__all__ = ["HFConfig", "HFConfigLike", "Layout", "hf_value", "num_experts"]


class HFConfig(Protocol):
    """A model's Hugging Face config as the package reads it: a transformers `PretrainedConfig`
    (a bridge's, a loaded model's) or config.json's keys as attributes (`types.SimpleNamespace`:
    preflight and the planner read the file without transformers, which takes seconds to
    import). Every decoder config has the keys below; optional ones (`head_dim`, `num_experts`,
    `moe_intermediate_size`, ...) are read with `getattr(hf, key, default)` or `hf_value`."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    intermediate_size: int
    tie_word_embeddings: bool


type HFConfigLike = HFConfig | Mapping[str, Any]
"""A HF config, or config.json as `json.load` gives it (a dict)."""


def hf_value(hf: HFConfigLike, key: str, default: object = None) -> Any:
    """`key` of a HF config (attributes or a dict), `default` when it has none: a JSON value."""
    return hf.get(key, default) if isinstance(hf, Mapping) else getattr(hf, key, default)


def num_experts(hf: HFConfigLike) -> int | None:
    """Routed experts per MoE layer, whichever key the model family uses; None: a dense model."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = hf_value(hf, name)
        if n:
            return int(n)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """The parallel layout (megatron-core semantics; DP is what is left of the world)."""

    tp: int = 1
    """Tensor parallel size."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None disables it."""
    cp: int = 1
    """Context parallel size."""
    ep: int = 1
    """Expert parallel size."""
    etp: int | None = None
    """Expert tensor parallel size; None means the same as parallel.tp (megatron-core default)."""
    dp: int | None = None
    """Data parallel size; None infers world_size / (tp * pp * cp). Set it to assert a layout."""
    sequence_parallel: bool | None = None
    """Sequence parallelism; None turns it on whenever tp > 1 (megatron-core requires it for MoE
    with tp > 1 and ep > 1, and it saves activation memory)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "dp", "vpp"):
            v = getattr(self, name)
            require(
                v is None or (isinstance(v, int) and v >= 1),
                f"parallel.{name}={v} must be an integer >= 1; change parallel.{name}",
            )
        require(
            self.vpp is None or self.pp > 1,
            f"parallel.vpp={self.vpp} needs pipeline parallelism; set parallel.pp > 1 or "
            "parallel.vpp to null",
        )
        require(
            not self.sequence_parallel or self.tp > 1,
            "parallel.sequence_parallel=true needs parallel.tp > 1; change parallel.tp or set "
            "parallel.sequence_parallel to null",
        )
        require(
            not (self.ep > 1 and self.tp > 1 and self.sequence_parallel is False),
            f"parallel.ep={self.ep} with parallel.tp={self.tp} needs sequence parallelism "
            "(megatron-core); set parallel.sequence_parallel to true or null",
        )

    @property
    def sp(self) -> bool:
        """Whether sequence parallelism is on."""
        return self.tp > 1 if self.sequence_parallel is None else self.sequence_parallel

    @property
    def expert_tp(self) -> int:
        """The effective expert tensor parallel size (etp, defaulting to tp)."""
        return self.tp if self.etp is None else self.etp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def name(self) -> str:
        """A short tag such as `tp2-ep4` (`single` for no parallelism)."""
        sizes = (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
        parts = [f"{k}{v}" for k, v in sizes if v > 1]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        if self.etp is not None:
            parts.append(f"etp{self.etp}")
        return "-".join(parts) or "single"

    def validate(self, world_size: int, hf_config: HFConfig, *, key: str = "parallel.") -> int:
        """Check the layout against the world size and the model; return the DP size.

        megatron-core's rules: TP x PP x CP x DP == world size; the expert grid ETP x EP x PP
        divides the world (expert DP = world / (ETP x EP x PP)), i.e. ETP x EP divides
        DP x CP x TP; EP divides the number of experts; TP divides the attention (and key-value)
        heads; PP x VPP divides the layers. `key` prefixes the name of the setting in messages
        (`parallel.` for the config, `--` for the command-line tools).
        """
        k = lambda name: f"{key}{name}"  # noqa: E731
        require(world_size >= 1, f"world size {world_size} must be >= 1")
        grid = self.tp * self.pp * self.cp
        require(
            world_size % grid == 0,
            f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*"
            f"{self.cp} = {grid}; change {k('tp')}, {k('pp')} or {k('cp')} (or the number of "
            "ranks)",
        )
        dp = world_size // grid
        if self.dp is not None and self.dp != dp:
            raise ConfigError(
                f"tp*pp*cp*dp = {grid}*{self.dp} = {grid * self.dp} != world size {world_size}; "
                f"change {k('dp')} (to {dp} or null)"
            )
        experts = num_experts(hf_config)
        if not experts:
            require(
                self.ep == 1 and self.etp in (None, 1, self.tp),
                f"{k('ep')}={self.ep} / {k('etp')}={self.etp} need an MoE model; the model has "
                f"no experts: set {k('ep')}=1 and leave {k('etp')} unset",
            )
        else:
            require(
                experts % self.ep == 0,
                f"{k('ep')}={self.ep} does not divide the model's num_experts={experts}; "
                f"change {k('ep')}",
            )
            expert_grid = self.expert_tp * self.ep
            require(
                (dp * self.cp * self.tp) % expert_grid == 0,
                f"etp*ep = {self.expert_tp}*{self.ep} = {expert_grid} does not divide dp*cp*tp "
                f"= {dp}*{self.cp}*{self.tp} = {dp * self.cp * self.tp} (megatron-core expert "
                f"data parallel = world / (etp*ep*pp)); change {k('ep')} or {k('etp')}",
            )
        heads = getattr(hf_config, "num_attention_heads", None)
        kv = getattr(hf_config, "num_key_value_heads", None)
        for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
            require(
                n is None or n % self.tp == 0,
                f"{k('tp')}={self.tp} does not divide the model's {what}={n}; change {k('tp')}",
            )
        layers = getattr(hf_config, "num_hidden_layers", None)
        stages = self.pp * (self.vpp or 1)
        require(
            layers is None or layers % stages == 0,
            f"pp*vpp = {self.pp}*{self.vpp or 1} = {stages} does not divide the model's "
            f"num_hidden_layers={layers}; change {k('pp')} or {k('vpp')}",
        )
        return dp

