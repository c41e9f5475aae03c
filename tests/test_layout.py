"""The package layers import in one direction: the wiring (async_rlhf.launch) on top may import
anything; the leaves (actors, learners, buffer) import the floor (async_rlhf without launch) and
themselves; the floor imports neither. Every import counts, a lazy one inside a function too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LEAVES = ("actors", "learners", "buffer")
WIRING = "async_rlhf.launch"


def _layer(module: str) -> str | None:
    """'wiring', 'floor', a leaf's name, or None for a module outside the project."""
    top = module.split(".")[0]
    if module == WIRING or module.startswith(WIRING + "."):
        return "wiring"
    if top == "async_rlhf":
        return "floor"
    return top if top in LEAVES else None


def _allowed(importer: str, imported: str) -> bool:
    if importer == "wiring" or imported is None:
        return True
    if importer == "floor":
        return imported == "floor"
    return imported in ("floor", importer)  # a leaf: the floor and itself


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in the file of `package` (its dotted package), absolute
    names; a relative import is resolved against the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from pkg import mod` may name a submodule: count pkg.mod for each name
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def violations(root: Path) -> list[str]:
    bad = []
    for path in sorted(root.glob("*/**/*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        importer = _layer(".".join(p for p in parts if p != "__init__"))
        if importer is None:
            continue  # tests, scripts
        for line, module in _imports(path, ".".join(parts[:-1])):
            if not _allowed(importer, _layer(module)):
                bad.append(f"{path.relative_to(root)}:{line}: {importer} imports {module}")
    return bad


def test_imports_run_from_the_wiring_down_to_the_floor():
    assert violations(ROOT) == []


@pytest.mark.parametrize("where, line", [
    ("async_rlhf/types.py", "from actors.tasks import score"),   # the floor imports a leaf
    ("actors/tasks.py", "from async_rlhf.launch import launcher"),  # a leaf imports the wiring
    ("learners/losses.py", "import buffer.codec"),                 # a leaf imports another leaf
    ("actors/engines/hf_engine.py", "from ...async_rlhf.launch import cli"),  # relative, to the wiring
    ("async_rlhf/types.py", "from ..actors import tasks"),         # relative, floor to a leaf
])
def test_a_violation_is_caught(tmp_path, where, line):
    for package in ("async_rlhf", *LEAVES):
        for path in (ROOT / package).rglob("*.py"):
            target = tmp_path / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    with (tmp_path / where).open("a") as f:
        f.write(f"\n\ndef _late():\n    {line}\n")
    assert [v for v in violations(tmp_path) if where in v] != []
