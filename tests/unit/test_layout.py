"""The package's layout as docs/ARCHITECTURE.md describes it (issue 40), read from the source (nothing imported):
the root holds only the faces, the modules' top-level imports form no circle, train() stays under 150 lines, and
an import inside a function says why in a comment."""

from __future__ import annotations

import ast
import io
import tokenize
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


def _whole_config_readers(tree: ast.AST) -> list[tuple[str, str]]:
    """(function, section) for each function that takes the whole config (a parameter ``cfg`` or annotated
    ``Config``) but reads one section of it and never uses it whole (passes, returns or keeps it)."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            annotation = ast.unparse(arg.annotation).strip("'\"") if arg.annotation else ""
            if arg.arg != "cfg" and annotation != "Config":
                continue
            read = {n.value for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                    and n.value.id == arg.arg}
            uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == arg.arg]
            sections = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.value in read}
            if len(uses) == len(read) and len(sections) == 1:
                found.append((fn.name, sections.pop()))
    return found


def test_a_function_that_reads_one_section_of_the_config_takes_that_section():
    offenders = [f"{p.relative_to(PACKAGE)}: {name} reads only cfg.{section}"
                 for p in sorted(PACKAGE.rglob("*.py")) for name, section in _whole_config_readers(ast.parse(p.read_text()))]
    assert not offenders, "take the section, not the whole Config:\n" + "\n".join(offenders)


def test_the_section_check_finds_a_function_that_reads_one_section():
    tree = ast.parse("def f(cfg, model):\n    return cfg.optim.lr * 2\n\n"
                     "def g(cfg):\n    return cfg.optim.lr + cfg.train.seed\n\n"
                     "def h(cfg):\n    return other(cfg) + cfg.optim.lr\n")
    assert _whole_config_readers(tree) == [("f", "optim")]


def _uncommented_inside_imports(source: str) -> list[tuple[int, str]]:
    """(line, function) of each import inside a function with no comment on its lines nor on the line above (a
    reason to stand there: an optional package, a measured start-up cost, a circle a top import would close)."""
    comments = {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    found = {}
    for fn in ast.walk(ast.parse(source)):  # outer functions first: a nested one's name wins
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found |= {n.lineno: fn.name for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))
                      and not comments & set(range(n.lineno - 1, n.end_lineno + 1))}
    return sorted(found.items())


def test_every_import_inside_a_function_says_why_in_a_comment():
    offenders = [f"{p.relative_to(PACKAGE)}:{line}: {name}"
                 for p in sorted(PACKAGE.rglob("*.py")) for line, name in _uncommented_inside_imports(p.read_text())]
    assert not offenders, "import at the top of the file, or say why not in a comment:\n" + "\n".join(offenders)


def test_the_import_check_finds_an_import_inside_a_function_without_a_comment():
    source = ("import json\n\n"
              "def f():\n    import os\n    return os.sep\n\n"
              "def g():\n    # optional package: peft (extra lora)\n    import peft\n\n"
              "def h():\n    from torch import (  # start-up: 2 s\n        nn,\n    )\n\n"
              "def k():\n    def inner():\n        from PIL import Image; return '#'\n")
    assert _uncommented_inside_imports(source) == [(4, "f"), (18, "inner")]
