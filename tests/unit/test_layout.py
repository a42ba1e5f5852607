"""The package's layout as docs/ARCHITECTURE.md describes it (issue 40), read from the source (nothing imported):
the root holds only the faces, the modules' top-level imports form no circle, and train() stays under 150 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "difftrain"
FACES = {"__init__.py", "__main__.py", "api.py", "cli.py", "config.py"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The difftrain modules ``path`` imports at its top level (the imports that run when it is imported)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found |= {n for n in names if n in modules}
    return found


def test_the_root_holds_only_the_faces():
    loose = {p.name for p in PACKAGE.glob("*.py")} - FACES
    assert not loose, f"modules at the package root that belong in a room: {sorted(loose)}"


def test_top_level_imports_form_no_circle():
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _top_level_imports(p, set(files)) - {m} for m, p in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_train_is_at_most_150_lines():
    tree = ast.parse((PACKAGE / "training" / "loop.py").read_text())
    (train,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train"]
    assert train.end_lineno - train.lineno + 1 <= 150
