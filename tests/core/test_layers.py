"""The package's layers (docs/architecture.md): imports go one way, downwards, and no module imports itself
back through others. Read from the source, imports inside functions included; no Ray, no torch."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rayrb"
LAYERS = ["errors", "core", "io", "durability", "actors", "handle", "integrations", "cli"]  # lowest first


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The ``rayrb`` modules ``path`` imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("rayrb")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayrb") and not node.level:
            for a in node.names:  # "from rayrb.io import chunks" imports the module rayrb.io.chunks
                sub = f"{node.module}.{a.name}"
                out.add(sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else node.module)
    return out


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


def test_every_module_belongs_to_a_layer():
    assert [m for m in graph() if layer(m) == len(LAYERS) and m != "rayrb"] == []


def test_imports_go_down_the_layers_only():
    up = sorted(f"{m} imports {dep}" for m, deps in graph().items() if m != "rayrb"
                for dep in deps if layer(dep) > layer(m))
    assert up == [], "imports that go up a layer:\n" + "\n".join(up)


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle of imports among the package's modules (package __init__ files that only re-export aside)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(g.get(m, ())):
            if dep not in g or dep == m:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if state.get(dep) is None and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if state.get(m) is None and (found := visit(m)):
            return found
    return None


def test_no_import_circle():
    g = {m: deps for m, deps in graph().items() if m != "rayrb"}
    cycle = find_cycle(g)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("g, cycle", [({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]), ({"a": {"b"}, "b": set()}, None)])
def test_the_circle_check_finds_a_circle(g, cycle):
    assert find_cycle(g) == cycle


def test_every_module_is_loaded_once_under_one_name():
    """Paths from before the layers (``rayrb.datasets.registry``, ``rayrb.buffer``, ...) are not importable: an
    alias loaded a second copy of a module under its old name (two dataset registries, say). Run in a fresh
    process so that import order is the one a user's program has."""
    import subprocess
    import sys

    code = r"""
import importlib, pkgutil, sys
import rayrb
old = ["rayrb.datasets.registry", "rayrb.datasets", "rayrb.buffer", "rayrb.allocation", "rayrb.chunks",
       "rayrb.coordinator", "rayrb.client", "rayrb.schema"]
importable = []
for name in old:
    try:
        importlib.import_module(name)
        importable.append(name)
    except ModuleNotFoundError:
        pass
for m in pkgutil.walk_packages(rayrb.__path__, "rayrb."):
    if not m.name.startswith(("rayrb.integrations", "rayrb.cli")):
        importlib.import_module(m.name)
files = {}
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    if name.startswith("rayrb") and f:
        files.setdefault(f, set()).add(id(mod))
twice = sorted(f for f, ids in files.items() if len(ids) > 1)
print(importable, twice)
assert not importable and not twice, (importable, twice)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]


def test_the_architecture_table_lists_every_module():
    """docs/architecture.md's layer table names each module of each layer (a subpackage as ``name/``), and no
    module that is gone."""
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for floor in ("core", "io", "durability", "actors", "handle", "integrations"):
        row = next(line for line in doc.splitlines() if line.startswith(f"| `rayrb.{floor}` |"))
        listed = set(re.findall(r"`([a-z_]+/?)`", row.split("|")[2]))
        here = {p.stem for p in (PACKAGE / floor).glob("*.py") if p.stem != "__init__"}
        here |= {p.name + "/" for p in (PACKAGE / floor).iterdir() if (p / "__init__.py").is_file()}
        assert listed == here, f"rayrb.{floor}: the table lists {sorted(listed - here)} that are not modules, " \
                               f"and leaves out {sorted(here - listed)}"
