"""The package's layering (docs/architecture.md), checked on the source: imports point down and never go round in
a cycle, stores are dumb, a name means one thing, the mover needs no `type: ignore`."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import kvtier

SRC = Path(kvtier.__file__).parent
# docs/architecture.md, "Which way imports go": a module imports from its own row or from rows below it.
ROWS = [
    {"__init__", "layout", "metrics", "report", "timing"},
    {"stores"},
    {"directory", "sizing", "config", "policies", "admission", "keys", "weights", "digests", "guard", "decide",
     "control", "traces", "analyze", "sim", "plan"},
    {"mover"},
    {"wiring"},
    {"cache"},
    {"integrations"},
    {"demo"},  # the in-process demo: TieredCache behind an engine stand-in
    {"rollout", "calibrate"},  # a real server over HTTP: the rollout's steps, drills, exactness; its measured costs
    {"bench"},  # the benchmarks: the rollout's server starter and slow disk for the vLLM figures
    {"cli"},  # the `kvtier` command: every command above
]
ROW = {name: i for i, row in enumerate(ROWS) for name in row}
# Names that several modules define on purpose, each time with the same meaning: a command module's entry point
# (`main`, `run`) and a subcommand's registration on the `kvtier` parser (`add`).
ENTRY_POINTS = {"main", "run", "add"}


def _part(module: str) -> str:
    """The folder or module right under kvtier that `module` (a dotted name) belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    path = SRC.parent.joinpath(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every kvtier import that runs (lazy ones included, `if TYPE_CHECKING:` ones not); `from
    a.b import c` imports the module `a.b.c` when there is one, else `a.b`."""
    tree = ast.parse(path.read_text())
    type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                 for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == "kvtier" or n.startswith("kvtier.")]
    return found


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "egg-info" not in str(p))


def _dotted(path: Path) -> str:
    """The module's name: kvtier.rollout.run for rollout/run.py, kvtier.rollout for rollout/__init__.py."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the kvtier modules it imports at run time. Importing `a.b.c` also runs the package `a.b`, but
    only as the way in: the edge is to the module named, as Python resolves a package importing its own parts."""
    modules = {_dotted(p): p for p in _modules()}
    return {name: {m for _, m in _runtime_imports(path) if m in modules} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (its first module repeated at its end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                return path[path.index(imported):] + [imported]
            if imported not in done and (found := visit(imported)):
                return found
        done.add(path.pop())
        return None

    for module in sorted(graph):
        if module not in done and (found := visit(module)):
            return found
    return None


def _definitions(body: list[ast.stmt]) -> Iterator[str]:
    """Names of the classes and functions a module defines at its top level (in its top-level `if` and `try`
    blocks too)."""
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                yield from _definitions(block)


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


def test_no_import_goes_round_in_a_cycle():
    """Every runtime import counts, lazy ones inside functions too: a cycle that only works because one side
    imports late is still two modules that each need the other."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    cycle = _cycle(_import_graph())
    assert cycle is None, "imports that go round: " + " -> ".join(cycle or [])


def test_a_public_name_is_defined_once():
    """A class or function name means one thing across the package: defined in one module only (the entry points'
    conventional names aside)."""
    where: dict[str, set[str]] = defaultdict(set)
    for path in _modules():
        for name in _definitions(ast.parse(path.read_text()).body):
            if not name.startswith("_"):
                where[name].add(str(path.relative_to(SRC)))
    twice = {name: sorted(paths) for name, paths in where.items() if len(paths) > 1 and name not in ENTRY_POINTS}
    assert not twice, f"defined in more than one module (rename by meaning, or keep one): {twice}"


def test_the_mover_needs_no_type_ignore():
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
