"""Every config key does something: each leaf of `Config` is read somewhere in the package.

A key that is validated and documented but never read (a cosine schedule that silently trains
at a constant learning rate) fails here. The check is static: the attribute name must be read
(`.name`, `getattr(x, "name")` or a `"name"` key of `dataclasses.asdict`) in a package module
other than the one that defines its dataclass, or inside the defining module outside the field
definition and its own checks. Whether reading it changes behaviour is each key's own test.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from megatron_gspo.config import Config, load_config

PKG = Path(__file__).resolve().parents[1] / "megatron_gspo"


def leaves(obj: object, prefix: str = "") -> dict[str, type]:
    """`section.key` -> the dataclass that owns the key, for every leaf of the config tree."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out |= leaves(value, key + ".")
        else:
            out[key] = type(obj)
    return out


def reads_outside_checks(tree: ast.AST) -> set[str]:
    """Attribute names read in `tree`, leaving out `__post_init__` bodies (validation is not
    use) and string constants (getattr / asdict key lookups)."""
    names: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            if node.name != "__post_init__":
                self.generic_visit(node)

        def visit_Attribute(self, node: ast.Attribute) -> None:
            if isinstance(node.ctx, ast.Load):
                names.add(node.attr)
            self.generic_visit(node)

        def visit_Constant(self, node: ast.Constant) -> None:
            if isinstance(node.value, str) and node.value.isidentifier():
                names.add(node.value)

    Visitor().visit(tree)
    return names


def unread_keys(package: Path) -> list[str]:
    cfg = load_config(None, ["model.hf_path=/m", "data.train_path=/d.jsonl"])
    read: set[str] = set()
    for path in package.rglob("*.py"):
        read |= reads_outside_checks(ast.parse(path.read_text()))
    return sorted(k for k in leaves(cfg) if k.rsplit(".", 1)[-1] not in read)


def test_every_config_key_is_read_by_the_package() -> None:
    assert unread_keys(PKG) == []


def test_the_check_finds_an_unread_key(tmp_path: Path) -> None:
    """The check can fail: a copy of the package where nothing reads `lr_schedule` (as on the
    main branch before this test existed) reports exactly that key."""
    for path in PKG.rglob("*.py"):
        text = path.read_text().replace("optim.lr_schedule", "optim.lr")
        text = text.replace("lr_decay_style=optim.lr_schedule", "lr_decay_style='constant'")
        dest = tmp_path / path.relative_to(PKG)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    assert unread_keys(tmp_path) == ["optim.lr_schedule"]


def test_leaves_cover_nested_sections() -> None:
    keys = leaves(load_config(None, ["model.hf_path=/m", "data.train_path=/d.jsonl"]))
    assert {"rollout.launch.num_engines", "rollout.client.api_key", "weights.fp8"} <= set(keys)
    assert keys["loss.eps_low"].__name__ == "PolicyLossConfig"
    assert Config.__name__ == "Config"
