"""No import loops among the product packages, and the CLI stays a leaf that nothing else imports.

The graph is read from the source (ast), not from running imports: every import statement counts, including
those under `if TYPE_CHECKING:` and inside functions, because a loop hidden there still ties two modules
together and turns into a runtime loop the day the import moves up. A package `__init__` counts as a module of
its own, so an `__init__` that imports its submodules while one of them imports the package back is a loop.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("fedmqtt", "broker", "ps_daemon", "site_agent", "schemas")
CLI = "fedmqtt.cli"
ENTRY_POINTS = {"fedmqtt.__main__"}  # `python -m fedmqtt` runs the CLI: the one place above it


@dataclass(frozen=True)
class Import:
    """One import statement's edge: `source` imports `target` (both module names) at `where` (path:line)."""

    source: str
    target: str
    where: str


def find_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> file, for every .py file of `packages` under `root` (`pkg/__init__.py` is `pkg`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _longest_known(name: str, modules: Mapping[str, Path]) -> str | None:
    """`name` or the longest prefix of it that is one of `modules` (`a.b.func` -> `a.b`); None if none is."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _anchor(module: str, path: Path, level: int) -> str:
    """The package a relative import of `level` dots in `module` starts from."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return package


def imports_of(module: str, path: Path, modules: Mapping[str, Path], root: Path) -> Iterator[Import]:
    """Every product module that an import statement anywhere in `module` names.

    `from X import a` imports the module `X.a` when there is one, else the name `a` of module `X`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    rel = path.relative_to(root)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [_longest_known(alias.name, modules) for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = _anchor(module, path, node.level)
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else _longest_known(base, modules))
        for target in targets:
            if target is not None and target != module:
                yield Import(module, target, f"{rel}:{node.lineno}")


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    modules = find_modules(root, packages)
    return [edge for name, path in modules.items() for edge in imports_of(name, path, modules, root)]


@functools.cache
def product_graph() -> tuple[Import, ...]:
    return tuple(import_graph(REPO))


def cycles(edges: Iterable[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e.target)
        graph.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return sorted(found)


def _describe(component: list[str], edges: Iterable[Import]) -> str:
    members = set(component)
    inside = sorted({f"    {e.source} -> {e.target} ({e.where})" for e in edges
                     if e.source in members and e.target in members})
    return f"  {' <-> '.join(component)}\n" + "\n".join(inside)


def test_no_import_cycles() -> None:
    edges = product_graph()
    loops = cycles(edges)
    assert not loops, "import cycles (every import statement counts):\n" + "\n".join(_describe(c, edges) for c in loops)


def test_nothing_outside_the_cli_imports_the_cli() -> None:
    """The CLI is the outermost layer: library code that needs a CLI helper means the helper is misplaced."""
    def in_cli(module: str) -> bool:
        return module == CLI or module.startswith(CLI + ".")

    offenders = sorted(f"{e.where}: {e.source} imports {e.target}" for e in product_graph()
                       if in_cli(e.target) and not in_cli(e.source) and e.source not in ENTRY_POINTS)
    assert not offenders, "modules outside fedmqtt/cli/ that import it:\n" + "\n".join(offenders)


# -- the checks check what they claim ------------------------------------------------------------------
def _write(root: Path, files: Mapping[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_hidden_and_relative_imports_count_and_a_package_importing_back_is_a_cycle(tmp_path: Path) -> None:
    # Prepare: pkg/__init__ imports its submodule, which imports the package back (inside a function);
    # a and b import each other, one of them only under TYPE_CHECKING, the other relatively.
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg import sub\n",
        "pkg/sub.py": "def f():\n    from pkg import VALUE\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "pkg/b.py": "from .a import A\nimport os\n",
        "pkg/c.py": "import pkg.sub\nfrom pkg.a import helper\n",
        "pkg/d.py": "from pkg import helpers\n",
    })
    # Execute
    edges = import_graph(tmp_path, ["pkg"])
    # Check
    assert cycles(edges) == [["pkg", "pkg.sub"], ["pkg.a", "pkg.b"]]
    seen = {(e.source, e.target) for e in edges}
    assert {("pkg.c", "pkg.sub"), ("pkg.c", "pkg.a"), ("pkg.d", "pkg")} <= seen
    assert not any(e.target == "os" for e in edges)  # only product modules are nodes


def test_the_real_graph_is_read() -> None:
    """The parser finds edges the product is known to have, so an empty graph cannot pass the cycle test."""
    seen = {(e.source, e.target) for e in product_graph()}
    assert ("ps_daemon.machine", "ps_daemon.transitions") in seen
    assert ("fedmqtt.strategies.registry", "fedmqtt.strategies.adafed") in seen
    assert ("ps_daemon.state", "ps_daemon.best_file") in seen  # under TYPE_CHECKING
