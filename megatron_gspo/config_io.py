"""Generic YAML <-> nested-dataclass machinery behind `megatron_gspo.config`.

Knows nothing about the sections themselves: typed coercion of YAML values against field
annotations, "did you mean" hints on unknown keys (difflib), `a.b=c` overrides resolved against
the dataclass tree, and field docstrings read back from the source.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = [
    "FLOAT_DTYPES",
    "ConfigError",
    "apply_override",
    "at_least",
    "build_dataclass",
    "describe_keys",
    "field_docs",
    "plain",
    "port",
    "positive",
    "read_yaml",
    "require",
]


class ConfigError(ValueError):
    """An invalid configuration; the message names the key to change."""


# torch's floating-point dtype names (aliases included) -> its canonical name (`str(torch.<name>)`
# without "torch."): dtype keys are checked without importing torch, so `megatron_gspo.config`
# and the planner load without it. tests/test_config.py compares the table with torch's own.
FLOAT_DTYPES: dict[str, str] = {
    "bfloat16": "bfloat16",
    "double": "float64",
    "float": "float32",
    "float16": "float16",
    "float32": "float32",
    "float4_e2m1fn_x2": "float4_e2m1fn_x2",
    "float64": "float64",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2": "float8_e5m2",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
    "half": "float16",
}


def require(ok: bool, msg: str) -> None:
    """Raise `ConfigError(msg)` unless `ok`."""
    if not ok:
        raise ConfigError(msg)


def positive(section: str, **values: float | int | None) -> None:
    """Each given `section.name` value is None or > 0, else a `ConfigError` naming the key."""
    for name, v in values.items():
        require(v is None or v > 0, f"{section}.{name}={v} must be > 0; change {section}.{name}")


def at_least(section: str, low: int, **values: float | int | None) -> None:
    """Each given `section.name` value is None or >= `low`, else a `ConfigError` naming the key
    (a negative count, port or delay has no meaning: issue 40, no silent no-ops)."""
    for name, v in values.items():
        require(
            v is None or v >= low, f"{section}.{name}={v} must be >= {low}; change {section}.{name}"
        )


def port(section: str, **values: int | None) -> None:
    """Each given `section.name` is None or a TCP port number (0..65535; what 0 means is the
    key's own docstring's)."""
    for name, v in values.items():
        require(
            v is None or 0 <= v <= 65535,
            f"{section}.{name}={v} is not a port number (0..65535); change {section}.{name}",
        )


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: object) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: object, key: str) -> Any:
    """Check / convert one YAML value against a field type; raise ConfigError naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return None
        errors = []
        for arm in typing.get_args(tp):
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, key)
            except ConfigError as e:
                errors.append(_type_name(arm))
                last = e
        if len(errors) == 1:
            raise last
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(errors)}; change {key}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        require(
            value in allowed,
            f"{key}={value!r} is not one of {' | '.join(map(str, allowed))}; change {key}",
        )
        return value
    if origin is list:
        require(isinstance(value, list), f"{key}={value!r} must be a list; change {key}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        require(isinstance(value, dict), f"{key} must be a mapping, got {value!r}")
        return build_dataclass(tp, value, key)
    if tp is bool:
        require(isinstance(value, bool), f"{key}={value!r} must be true or false; change {key}")
        return value
    if tp is int:
        require(
            isinstance(value, int) and not isinstance(value, bool),
            f"{key}={value!r} must be an integer; change {key}",
        )
        return value
    if tp is float:
        # YAML 1.1 reads "3e-4" (no dot, unsigned exponent) as a string; accept it as a float.
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        require(
            isinstance(value, int | float) and not isinstance(value, bool),
            f"{key}={value!r} must be a number; change {key}",
        )
        # Every float key, as a class: no setting means inf or NaN (an inf learning rate made
        # the weights non-finite, pushed and checkpointed them; a NaN compares False to every
        # bound, so a check `x > 0` alone would let it through).
        require(
            math.isfinite(value),
            f"{key}={value!r} is not a finite number; change {key}",
        )
        return float(value)
    if tp is str:
        require(isinstance(value, str), f"{key}={value!r} must be a string; change {key}")
        return value
    raise TypeError(f"unsupported config field type {tp!r} at {key}")  # a bug in this module


def _suggest(name: str, options: list[str], prefix: str = "") -> str:
    """A "did you mean" hint naming the full dotted key of the closest valid field."""
    dot = f"{prefix}." if prefix else ""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {dot + close[0]!r}?"
    return f"; valid keys under {prefix or 'the top level'}: {', '.join(options)}"


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(
                f"unknown config key {key!r}" + _suggest(str(name), list(fields), prefix)
            )
        kwargs[name] = _coerce(value, hints[name], key)
        # An empty string is no value: `checkpoint.dir=` wrote no checkpoint and said nothing,
        # `logging.dir=` would write into the working directory. Refused for every string key
        # but those whose own default is "" (their documented "unset").
        if isinstance(kwargs[name], str) and not kwargs[name].strip():
            require(
                fields[name].default == "",
                f"{key}={kwargs[name]!r} is empty; set {key}"
                + (", or null to leave it unset" if _accepts_none(hints[name]) else ""),
            )
    for name, f in fields.items():
        if (
            name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            key = f"{prefix}.{name}" if prefix else name
            raise ConfigError(f"missing required config key {key!r}; set {key}")
    return cls(**kwargs)


def apply_override(root: type, data: dict[str, Any], override: str) -> None:
    """Apply one `a.b=c` override to the raw nested dict `data`, resolving the path against the
    dataclass `root` (unknown keys fail here, with a suggestion)."""
    path, sep, text = override.partition("=")
    require(bool(sep and path), f"override {override!r} is not of the form section.key=value")
    parts = path.strip().split(".")
    cls: Any = root
    node = data
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        require(
            dataclasses.is_dataclass(cls),
            f"override {override!r}: {where} is not a section; it has no key {part!r}",
        )
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            full = ".".join(parts[: depth + 1])
            raise ConfigError(
                f"unknown config key {full!r} in --set {override}" + _suggest(part, names, where)
            )
        tp = _hints(cls)[part]
        if depth < len(parts) - 1:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node, cls = child, _section(tp)
    text = text.strip()
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader) if text else ""
    except yaml.YAMLError as e:
        if not _accepts_str_only(tp):
            raise ConfigError(
                f"--set {override}: {text!r} is not a YAML value ({_yaml_problem(e)}); "
                "quote it, e.g. --set 'key=\"...\"', or fix the [list] / {mapping}"
            ) from None
        value = text  # a string field: `data.system_prompt=[Important] Answer briefly`
    # A string field keeps the literal text: `--set model.hf_path=007` must not become 7.
    if _accepts_str_only(tp) and not isinstance(value, str) and value is not None:
        value = text
    node[parts[-1]] = value


def _section(tp: object) -> object:
    """The dataclass inside an optional section type (`LaunchConfig | None`), else `tp`."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if len(arms) == 1:
            return arms[0]
    return tp


def _accepts_none(tp: object) -> bool:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(tp)


def _accepts_str_only(tp: object) -> bool:
    arms = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        arms = [tp]
    return all(a is str for a in arms)


def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a config dataclass to its docstring (the string literal under it)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def plain(value: Any) -> Any:
    """`value` with tuples as lists, recursively (what YAML and JSON can hold)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def read_yaml(path: Path) -> Any:
    """The parsed YAML of a config file; every way it can fail is a ConfigError naming the file
    (and the line for syntax or encoding errors), so the trainer prints one line, no traceback."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (--config)") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a YAML config file (--config)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as e:
        raise ConfigError(
            f"{path}:{e.line}: duplicate key {e.key!r} (first at line {e.first}); YAML keeps "
            "only the last one, so merge the two or remove one"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {_yaml_problem(e)}") from None


def _yaml_problem(e: yaml.YAMLError) -> str:
    return getattr(e, "problem", None) or getattr(e, "context", None) or "invalid YAML"


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: object, line: int, first: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.line, self.first = key, line, first
        self.problem = f"duplicate key {key!r} (lines {first} and {line})"


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key given twice in one mapping (PyYAML keeps the last
    silently: a second `optim:` block would reset the first one's values)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen and key != "<<":
                raise _DuplicateKey(key, line, seen[key])
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def describe_keys(cfg: object) -> str:
    """Every leaf key with its current value and docstring (`python -m megatron_gspo.config
    --keys`)."""
    lines: list[str] = []

    def walk(obj: object, prefix: str) -> None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"describe_keys takes a config dataclass, not {type(obj).__name__}")
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
                continue
            doc = " ".join(docs.get(f.name, "").split())
            lines.append(f"{prefix}{f.name} = {value!r}\n    {doc}")

    walk(cfg, "")
    return "\n".join(lines) + "\n"
