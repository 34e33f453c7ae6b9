"""The package's layering (docs/architecture.md), checked on the source: imports point down, stores are dumb,
files stay small, the mover needs no `type: ignore`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvtier

SRC = Path(kvtier.__file__).parent
# docs/architecture.md, "Which way imports go": a module imports from its own row or from rows below it.
ROWS = [
    {"__init__", "layout", "metrics", "report", "timing"},
    {"stores"},
    {"directory", "sizing", "config", "policies", "admission", "keys", "weights", "guard", "decide", "traces",
     "analyze", "sim", "plan"},
    {"mover"},
    {"wiring"},
    {"cache"},
    {"integrations"},
    {"cli", "bench", "demo", "rollout"},
]
ROW = {name: i for i, row in enumerate(ROWS) for name in row}


def _part(module: str) -> str:
    """The folder or module right under kvtier that `module` (a dotted name) belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every kvtier import that runs (lazy ones included, `if TYPE_CHECKING:` ones not)."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module == "kvtier":  # `from kvtier import bench` is kvtier.bench
            names = [f"kvtier.{a.name}" if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file() else "kvtier"
                     for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == "kvtier" or n.startswith("kvtier.")]
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "egg-info" not in str(p))


def test_every_part_of_the_package_has_a_row():
    parts = {p.relative_to(SRC).parts[0].removesuffix(".py") for p in _modules()}
    assert parts - {"__main__"} <= set(ROW), f"add to ROWS (and docs/architecture.md): {parts - set(ROW)}"


def test_imports_point_down():
    upward = []
    for path in _modules():
        mine = ROW[path.relative_to(SRC).parts[0].removesuffix(".py")]
        for line, module in _runtime_imports(path):
            if ROW[_part(module)] > mine:
                upward.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def test_stores_import_nothing_but_stores_layout_and_the_format_version():
    for path in (SRC / "stores").glob("*.py"):
        for line, module in _runtime_imports(path):
            assert module in ("kvtier", "kvtier.layout") or module.startswith("kvtier.stores"), (
                f"stores/{path.name}:{line} imports {module}")


def test_files_stay_small_and_the_mover_needs_no_type_ignore():
    big = [f"{p.relative_to(SRC)}: {n}" for p in _modules() if (n := len(p.read_text().splitlines())) > 400]
    assert not big, f"files over 400 lines: {big}"
    for path in (SRC / "mover").glob("*.py"):
        assert "type: ignore" not in path.read_text(), path.name


def test_the_rollout_imports_neither_vllm_nor_torch():
    """`kvtier rollout` drives a server over HTTP (often another machine's): it checks its arguments, and runs,
    without importing an engine. vLLM is imported by the servers it starts, and looks its connector up by name."""
    rollout = [f"kvtier.rollout.{p.stem}" for p in (SRC / "rollout").glob("*.py") if p.stem != "__init__"]
    code = (f"import sys\nfor m in {rollout + ['kvtier.cli.main']!r}: __import__(m)\n"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing the rollout imported {out.strip()}"
