"""The map stays true: every repository path, config key and dotted name of the package that the
docs and docstrings name exists.

Where paths are read: every word of the Markdown files (`README.md`, `CONTRIBUTING.md`,
`docs/**/*.md`, `examples/recipes/README.md`, `patches/README.md`, ...: `markdown_files`),
backticked or not, code blocks included, plus their link targets; every word of the docstrings
(modules, classes, functions, config fields: every string statement) of `megatron_gspo/`,
`tools/`, `benchmarks/` and `tests/`; the comments of the shell scripts and YAML files under
`scripts/` and `examples/`.

What counts as a repository path (the rule):
- A word with a "/" that ends in "/" (a folder) or whose last part has one of `SUFFIXES`
  (`megatron_gspo/train.py`, `docs/`, `examples/recipes/`). Metric names
  (`rollout/groups_kept`, `eval/pass@4`), config keys (`rollout.max_staleness`: no "/"),
  "q/k/v" and "bf16/FP8" have neither, so they are not paths.
- ... whose first part is a top-level entry of the repository (`tools/plot_metrics.py`,
  `tests/rollout/`; not one that `.gitignore` names, such as `runs/`), a
  subpackage of `megatron_gspo/` (`rollout/scheduler.py` is
  `megatron_gspo/rollout/scheduler.py`), or an entry of the naming file's own folder
  (`embedded/server.py` in `engines/__init__.py`, `img/x.png` in `docs/`). Anything else is
  not ours and is skipped: upstream paths (`sglang/srt/...`, `megatron/core/...`,
  `megatron/training/...`), run outputs (`runs/...`), placeholders (a word with `<`, `*`, `$`,
  `~`, `{`). It must exist in the work tree, relative to one of those roots.
- A bare file name with one of `BARE_SUFFIXES` and no "/" (`policy.py`) must be the name of
  some file of the repository (it may be relative to a folder named nearby).
- Markdown link targets (`[text](docs/x.md)`, not URLs) are relative to the document's folder
  and must exist.
- Nothing points outside the repository: no docstring or comment word starting with `../` that
  leaves it (checked after resolving against the naming file's folder and the repository
  root; in Markdown such words are commands' arguments, `git worktree add ../run`, and the
  links are checked as links), no `/work/...`, and none of the engineers' notes
  (`shared/GSPO.md`, `shared/notes/...`): a reader of the repository has only the repository.

Config keys: a word of the same documents and docstrings that starts with a config section and a dot
(`rollout.max_staleness`, `rollout.launch.colocated=true`: the value is cut off) must be a key or
a section of the config (what `python -m megatron_gspo.config --keys` lists). Words with a "/"
or a file suffix (`train.py`, `train.log`), calls (`model.named_parameters()`), dotted module
names (`weights.config.WeightSyncConfig`: its first two parts name a module of the package),
names defined in a root module (`train.cli` in `train.py`) and the few `NOT_KEYS` (each with its
reason) are not keys.

Defaults: a Markdown table cell that holds only backticked keys with values
(`rollout.oversample: 1.0`, comma-separated) states their defaults, which must be the config's
(the value read as YAML); in prose such a span is a setting.

Dotted names of the package (`megatron_gspo.engines.client.SGLangClient`, and package-relative
ones whose first part is a subpackage: `engines.connect.per_engine_clients`; not upstream's
`megatron.core...`, and not config keys: when the first part is also a config section, the
second must name a module of it, `rollout.scheduler.TURN_CONTEXT`): the longest prefix that is
a module or package must be followed by a name it defines, imports or holds as a submodule.

A planted document and docstring with each kind of violation must be reported, and the
non-paths above must not be.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_gspo"

SUFFIXES = (
    ".py", ".md", ".yaml", ".yml", ".sh", ".txt", ".toml", ".json", ".png", ".sbatch",
    ".cfg", ".ini",
)  # fmt: skip
BARE_SUFFIXES = (".py", ".sh", ".sbatch")
# paths of upstream packages whose first part is also one of ours
UPSTREAM_PREFIXES = ("megatron/core/", "megatron/training/", "megatron/bridge/")
PLACEHOLDER_CHARS = "<>*$~{}"
OUTSIDE = re.compile(r"^/work/|(^|/)shared/(notes/|[A-Z]+\.md)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S*")
LINK = re.compile(r"\]\(([^)\s]+)\)")
BARE_NAME = re.compile(r"^[\w-]+(" + "|".join(re.escape(s) for s in BARE_SUFFIXES) + ")$")
# word boundaries: whitespace and the punctuation that wraps paths in prose, code and tables
SPLIT = re.compile(r"[\s`'\"()\[\],;|=]+")


def _words(text: str) -> Iterator[str]:
    """Every candidate word of `text`: URLs removed, split at whitespace and wrapping
    punctuation, trailing sentence punctuation stripped."""
    for raw in SPLIT.split(URL.sub(" ", text)):
        word = raw.rstrip(".:!?").lstrip(":")
        if word:
            yield word


def _ignored() -> set[str]:
    """Names `.gitignore` ignores outright (`/runs/`, `build/`), and the tools' caches: what a
    work tree may hold that the repository does not."""
    names = {".git", "__pycache__", ".ruff_cache", ".mypy_cache", ".pytest_cache"}
    for line in (REPO / ".gitignore").read_text().splitlines():
        name = line.strip().strip("/")
        if name and not name.startswith("#") and not any(c in name for c in "*?[!/"):
            names.add(name)
    return names


def _top_level() -> set[str]:
    ignored = _ignored()
    return {p.name for p in REPO.iterdir() if p.name not in ignored and p.name != ".gitignore"}


def _subpackages() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def _all_file_names() -> set[str]:
    skip = _ignored()
    names = set()
    for p in REPO.rglob("*"):
        parts = p.relative_to(REPO).parts
        if not skip.intersection(parts) and not any(x.endswith(".egg-info") for x in parts):
            names.add(p.name)
    return names


@dataclasses.dataclass(frozen=True)
class Roots:
    """What a path may be relative to: the repository's top-level entries and the package's
    subpackages, the set of every file name (for bare names), and the ignored names (never a
    root, even where a work tree holds them)."""

    top: frozenset[str]
    subpackages: frozenset[str]
    file_names: frozenset[str]
    ignored: frozenset[str]

    @classmethod
    def of_repo(cls) -> Roots:
        return cls(
            frozenset(_top_level()),
            frozenset(_subpackages()),
            frozenset(_all_file_names()),
            frozenset(_ignored()),
        )


def _is_path_like(word: str) -> bool:
    if "/" not in word or "://" in word:
        return False
    return word.endswith("/") or word.rsplit("/", 1)[1].endswith(SUFFIXES)


def check_text(text: str, where: Path, roots: Roots, markdown: bool) -> list[str]:
    """Violations of the module docstring's rule in `text`, named by `where` (a file of the
    repository: its folder is a root too). Each entry: "<file>: <word>: <why>"."""
    rel = where.relative_to(REPO)
    here = where.parent
    bad: list[str] = []

    def report(word: str, why: str) -> None:
        entry = f"{rel}: {word}: {why}"
        if entry not in bad:
            bad.append(entry)

    if markdown:
        for target in LINK.findall(text):
            if URL.match(target) or target.startswith(("#", "mailto:")):
                continue
            path = target.split("#", 1)[0]
            if path and not (here / path).resolve().exists():
                report(target, "link target does not exist")
    for word in _words(text):
        if OUTSIDE.search(word):
            report(word, "points outside the repository (name a file in it, or say it)")
            continue
        if word.startswith("../") and markdown:
            continue  # a command's argument (`git worktree add ../run`); links are checked above
        if word.startswith("../"):
            resolved = [(base / word).resolve() for base in (here, REPO)]
            if not any(r.is_relative_to(REPO) and r.exists() for r in resolved):
                report(word, "points outside the repository or to nothing")
            continue
        if any(c in word for c in PLACEHOLDER_CHARS) or word.startswith("/"):
            continue
        if _is_path_like(word):
            path = word.removeprefix("./")
            first = path.split("/", 1)[0]
            if path.startswith(UPSTREAM_PREFIXES):
                continue
            bases = []
            if first in roots.top:
                bases.append(REPO)
            if first in roots.subpackages:
                bases.append(PACKAGE)
            if first not in roots.ignored and (here / first).exists():
                bases.append(here)
            if not bases:
                continue  # not ours: upstream, run outputs, a user's files
            if not any((base / path).exists() for base in bases):
                report(word, "no such file or folder in the repository")
        elif BARE_NAME.match(word):
            if word not in roots.file_names:
                report(word, "no file of this name in the repository")
    return bad


@functools.cache
def default_config() -> Any:
    """The config with every default (the two required keys set to placeholders), as
    `python -m megatron_gspo.config --keys` shows it."""
    from megatron_gspo.config import parse_cli

    cfg, _ = parse_cli(["--set", "model.hf_path=MODEL", "--set", "data.train_path=DATA.jsonl"])
    return cfg


def config_keys() -> set[str]:
    """Every key and section of the config, dotted (`rollout`, `rollout.launch`,
    `rollout.launch.colocated`), read from a default config's dataclasses."""
    cfg = default_config()
    keys: set[str] = set()

    def walk(obj: object, prefix: str) -> None:
        for f in dataclasses.fields(obj):  # type: ignore[arg-type]
            keys.add(prefix + f.name)
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")

    walk(cfg, "")
    return keys


KEY_WORD = re.compile(r"^[a-z_]+(\.[a-z_][a-z0-9_]*)+$")


# dotted words that start like a key and are not one, each with its reason
NOT_KEYS = {
    "optim.lrr": "the misspelt key in an example of the unknown-key error",
    "model.norm.weight": "a tensor name in an example of the missing-tensor error",
}
NOT_KEY_SUFFIXES = (
    *SUFFIXES, ".log", ".pt", ".jsonl", ".lock", ".parquet", ".csv", ".arrow", ".safetensors"
)
CALL = re.compile(r"([\w.]+)\(")


@functools.cache
def _module_names(module: Path) -> frozenset[str]:
    """Top-level functions, classes and assigned names of `module`, and every name it imports
    anywhere (a package's lazy exports are imported under TYPE_CHECKING); empty if no file."""
    if not module.exists():
        return frozenset()
    names = set()
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


MODULE_WORD = re.compile(r"^megatron_gspo(\.[A-Za-z_]\w*)+$")
RELATIVE_WORD = re.compile(r"^[a-z_]+(\.[A-Za-z_]\w*)+$")


def _qualified(word: str, sections: set[str]) -> str | None:
    """`word` as a dotted name of the package (`engines.client.SGLangClient` ->
    `megatron_gspo.engines.client.SGLangClient`), or None when it is not one: its first part is
    no subpackage, it is upstream's (`megatron.core...`), or it is a config key (the first part
    is also a section, `rollout.max_staleness`, and the second names no module of it)."""
    if MODULE_WORD.match(word):
        return word
    if not RELATIVE_WORD.match(word):
        return None
    first, second = word.split(".")[:2]
    if first == "megatron" or not (PACKAGE / first / "__init__.py").exists():
        return None
    is_module = (PACKAGE / first / f"{second}.py").exists() or (PACKAGE / first / second).is_dir()
    if first in sections and not is_module:
        return None
    return f"megatron_gspo.{word}"


def check_modules(text: str, where: Path, sections: set[str]) -> list[str]:
    """Dotted names of the package in `text` (`megatron_gspo.engines.client.SGLangClient`,
    `python -m megatron_gspo.plan`, `engines.connect.per_engine_clients`) whose module does not
    exist, or whose first name after the module is not defined or imported there."""
    bad: list[str] = []
    for word in _words(text):
        name = _qualified(word, sections)
        if name is None:
            continue
        parts = name.split(".")
        for i in range(len(parts), 0, -1):  # the longest prefix that is a module or package
            base = REPO.joinpath(*parts[:i])
            module = base.with_suffix(".py") if base.with_suffix(".py").exists() else None
            module = module or (base / "__init__.py" if (base / "__init__.py").exists() else None)
            if module is not None:
                break
        rest = parts[i:]
        if not rest or rest[0] in _module_names(module) or (base / rest[0]).exists():
            continue
        entry = f"{where.relative_to(REPO)}: {word}: {rest[0]} is not in {module.relative_to(REPO)}"
        if entry not in bad:
            bad.append(entry)
    return bad


def check_keys(text: str, where: Path, keys: set[str]) -> list[str]:
    """Words of `text` that look like a key of a config section but are not one."""
    sections = {k for k in keys if "." not in k}
    calls = set(CALL.findall(text))
    bad: list[str] = []
    for word in _words(text):
        if not KEY_WORD.match(word) or word.split(".", 1)[0] not in sections:
            continue
        if word in keys or word in NOT_KEYS or word in calls or word.endswith(NOT_KEY_SUFFIXES):
            continue
        first, second = word.split(".")[:2]
        if (PACKAGE / first / f"{second}.py").exists() or (PACKAGE / first / second).is_dir():
            continue  # a module of the package (`weights.config.WeightSyncConfig`)
        if second in _module_names(PACKAGE / f"{first}.py"):
            continue  # a function of a root module (`train.cli`, `checkpoint.required_files`)
        entry = f"{where.relative_to(REPO)}: {word}: not a config key"
        if entry not in bad:
            bad.append(entry)
    return bad


TABLE_DEFAULT = re.compile(r"`([a-z_]+(?:\.[a-z_][a-z0-9_]*)+): ([^`]+)`")
DEFAULTS_CELL = re.compile(rf"^{TABLE_DEFAULT.pattern}(,\s*{TABLE_DEFAULT.pattern})*$")


def check_defaults(text: str, where: Path) -> list[str]:
    """Cells of Markdown tables that hold only keys with values (`rollout.oversample: 1.0`,
    comma-separated) where a value (read as YAML) is not that key's default."""
    cfg = default_config()
    bad: list[str] = []
    cells = [c.strip() for line in text.splitlines() if line.startswith("|")
             for c in re.split(r"(?<!\\)\|", line)]  # fmt: skip
    for cell in cells:
        if not DEFAULTS_CELL.match(cell):
            continue
        for key, value in TABLE_DEFAULT.findall(cell):
            default: Any = cfg
            for part in key.split("."):
                default = getattr(default, part, None)
            stated = yaml.safe_load(value)
            if isinstance(default, tuple):
                default = list(default)
            if not (stated == default and isinstance(stated, bool) == isinstance(default, bool)):
                bad.append(f"{where.relative_to(REPO)}: {key}: {value} (default: {default!r})")
    return bad


def _comments(path: Path) -> str:
    """The text after every "#" of a shell script or YAML file, shebang left out."""
    lines = path.read_text().splitlines()
    return "\n".join(ln.split("#", 1)[1] for ln in lines if "#" in ln and not ln.startswith("#!"))


MARKDOWN_FOLDERS = (
    "docs", "examples", "patches", "megatron_gspo", "tools", "benchmarks", "scripts", "tests",
)  # fmt: skip


def markdown_files() -> list[Path]:
    """The repository's Markdown: the top level's and every file under `MARKDOWN_FOLDERS`."""
    found = sorted(REPO.glob("*.md"))
    for folder in MARKDOWN_FOLDERS:
        found += sorted((REPO / folder).rglob("*.md"))
    return found


@functools.cache
def sources() -> tuple[tuple[Path, str, bool], ...]:
    """(file, text to check, is Markdown) for every document and docstring the rule covers
    (parsed once for both tests)."""
    return tuple(_sources())


def _sources() -> Iterator[tuple[Path, str, bool]]:
    for path in markdown_files():
        yield path, path.read_text(), True
    for folder in ("megatron_gspo", "tools", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # the rule above names bad paths on purpose
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                # a string statement: a docstring, or the docstring of a config field
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                    if isinstance(node.value.value, str):
                        yield path, node.value.value, False
    for folder in ("scripts", "examples"):
        for suffix in ("*.sh", "*.sbatch", "*.yaml"):
            for path in sorted((REPO / folder).rglob(suffix)):
                yield path, _comments(path), False


def test_every_path_named_by_the_docs_and_docstrings_exists() -> None:
    roots = Roots.of_repo()
    bad = [v for path, text, md in sources() for v in check_text(text, path, roots, md)]
    assert not bad, "paths that do not exist in the repository:\n" + "\n".join(bad)


def test_every_config_key_named_by_the_docs_exists() -> None:
    keys = config_keys()
    bad = [v for path, text, _ in sources() for v in check_keys(text, path, keys)]
    assert not bad, "config keys that do not exist:\n" + "\n".join(bad)


def test_every_module_named_by_the_docs_and_docstrings_exists() -> None:
    sections = {k for k in config_keys() if "." not in k}
    bad = [v for path, text, _ in sources() for v in check_modules(text, path, sections)]
    assert not bad, "dotted names of the package that do not exist:\n" + "\n".join(bad)


def test_a_planted_module_name_that_does_not_exist_is_reported() -> None:
    text = (
        "`megatron_gspo.engines.client.SGLangClient`, `python -m megatron_gspo.plan`, "
        "`megatron_gspo.algo.gspo_loss` (a lazy export), `megatron_gspo.engines.embedded`; "
        "but `megatron_gspo.rollout.sglang_client.SGLangClient` and "
        "`megatron_gspo.engines.client.GoneClient` are not there. Package-relative: "
        "`engines.connect.per_engine_clients`, `algo.PolicyLossConfig`, `rollout.scheduler."
        "TURN_CONTEXT` and, not ours, `megatron.core.parallel_state`, `rollout.max_staleness`; "
        "but `engines.sglang_client.SGLangClient` and `engines.weight_group.gone` are not there."
    )
    sections = {k for k in config_keys() if "." not in k}
    found = check_modules(text, REPO / "docs" / "planted.md", sections)
    assert [v.split(": ")[1] for v in found] == [
        "megatron_gspo.rollout.sglang_client.SGLangClient",
        "megatron_gspo.engines.client.GoneClient",
        "engines.sglang_client.SGLangClient",
        "engines.weight_group.gone",
    ], found


def test_every_default_a_docs_table_states_is_the_default() -> None:
    bad = [v for path, text, md in sources() if md for v in check_defaults(text, path)]
    assert not bad, "defaults in the docs' tables that are not the config's:\n" + "\n".join(bad)


def test_a_planted_wrong_default_is_reported() -> None:
    text = (
        "| `rollout.oversample: 1.0` | `rollout.turn_stop: []`, `eval.path: null` |\n"
        "| `rollout.max_staleness: 2` | `rollout.async_rollout: 0` |\n"
        "| `loss.kl_coef: 0.0` | with `rl.pi_old: recompute` (a setting in prose) |\n"
        "Outside a table, `rollout.max_staleness: 2` is a setting, not a default.\n"
    )
    found = check_defaults(text, REPO / "docs" / "planted.md")
    assert [v.split(": ")[1] for v in found] == [
        "rollout.max_staleness",
        "rollout.async_rollout",
    ], found


def test_a_planted_key_that_does_not_exist_is_reported() -> None:
    text = (
        "`rollout.max_staleness`, `rollout.launch.colocated=true`, "
        "`weights.config.WeightSyncConfig`, `train.py`, `rollout/groups_kept`, "
        "`cfg.rollout.temperature`, `train.cli`, "
        "`model.named_parameters()`; but `rollout.staleness` "
        "and `eval.every_steps: 5` are not keys."
    )
    found = check_keys(text, REPO / "docs" / "planted.md", config_keys())
    assert [v.split(": ")[1] for v in found] == ["rollout.staleness", "eval.every_steps"], found


def test_a_planted_violation_of_each_kind_is_reported_and_non_paths_are_not() -> None:
    roots = Roots.of_repo()
    doc = REPO / "docs" / "planted.md"
    planted_doc = (
        "Talks to `rollout/sglang_client.py` (gone), see `docs/nowhere.md` and "
        "[the map](nowhere.md); run `python tools/no_such_tool.py --x`; the client is "
        "`sglang_client.py`.\n"
        # none of these is ours or a path: must not be reported
        "Logs `rollout/groups_kept` and `eval/pass@4`; key `rollout.max_staleness`; "
        "upstream `sglang/srt/managers/io_struct.py` and `megatron/core/transformer/moe/router.py`;"
        " outputs `runs/tiny_moe_cpu/train.log`; a placeholder `<dir>/.mgspo.lock`; real ones: "
        "`rollout/scheduler.py`, `megatron_gspo/engines/`, [reliability](reliability.md), "
        "`tests/test_docs_paths.py`, `policy.py`, bf16/FP8, q/k/v; `cd ../study-run`.\n"
    )
    found = check_text(planted_doc, doc, roots, markdown=True)
    assert [v.split(": ")[1] for v in found] == [
        "nowhere.md",
        "rollout/sglang_client.py",
        "docs/nowhere.md",
        "tools/no_such_tool.py",
        "sglang_client.py",
    ], found
    module = PACKAGE / "algo" / "planted.py"
    planted_docstring = (
        "The math is in ../shared/GSPO.md; the rules in /work/shared/notes/gpu-topology.md.\n"
        "Next to losses.py and `../rollout/experience.py` (real); `embedded/server.py` is not "
        "in algo/.\n"
    )
    found = check_text(planted_docstring, module, roots, markdown=False)
    assert [v.split(": ")[1] for v in found] == [
        "../shared/GSPO.md",
        "/work/shared/notes/gpu-topology.md",
    ], found
    # a folder the work tree holds but .gitignore names (as runs/ after a run) is no root
    as_ignored = dataclasses.replace(
        roots, top=roots.top - {"tests"}, ignored=roots.ignored | {"tests"}
    )
    assert check_text("`tests/gone.py`", REPO / "README.md", as_ignored, markdown=True) == []
    found = check_text("`embedded/server.py`", PACKAGE / "engines" / "x.py", roots, False)
    assert found == []
    found = check_text("`embedded/gone.py`", PACKAGE / "engines" / "x.py", roots, False)
    assert [v.split(": ")[1] for v in found] == ["embedded/gone.py"], found
