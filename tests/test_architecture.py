"""The package's shape: imports run one way (no cycle), only ``families/`` knows a family by name,
and no module grows past a screenful of screens."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "imglora"
MAX_LINES = 500


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every imglora module ``name`` imports, at any depth (function-level imports included), plus
    the packages importing it executes (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``),
    except the packages ``name`` itself lies in (they are already being imported when it runs)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        for t in targets:
            if not t.startswith("imglora"):
                continue
            while t and t not in known:
                t = t.rpartition(".")[0]
            parts = t.split(".")
            found.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    own = name.split(".")
    found -= {".".join(own[:i]) for i in range(1, len(own) + 1)}
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_the_import_graph_has_no_cycle() -> None:
    g = graph()
    assert len(g) > 40  # the walk found the package
    assert find_cycle(g) is None, " -> ".join(find_cycle(g))


def test_the_core_never_imports_a_family_and_commands_reach_them_through_the_registry() -> None:
    g = graph()
    # the front ends (the CLI, the web UI) and the commands may reach the families, through the registry
    core = [n for n in g if not n.startswith(("imglora.families", "imglora.commands", "imglora.ui")) and n not in
            ("imglora.cli", "imglora.cli_eval", "imglora.cli_merge", "imglora.__main__")]
    for n in core:
        assert not {m for m in g[n] if m.startswith("imglora.families")}, f"{n} imports a family module"
    for n in (m for m in g if m.startswith(("imglora.commands", "imglora.ui"))):
        reached = {m for m in g[n] if m.startswith("imglora.families")}
        assert reached <= {"imglora.families"}, f"{n} reaches {reached - {'imglora.families'}} past the registry"


FAMILY_NAMES = re.compile(r"sdxl|flux|llm", re.IGNORECASE)
NOT_FAMILY_NAMES = re.compile(r"fullmatch", re.IGNORECASE)  # words that merely contain one (re.fullmatch)


def code_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every name and string in the module, docstrings and comments left out."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.add(first.lineno)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING) and tok.start[0] not in docstrings:
            out.append((tok.start[0], tok.string))
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", None):  # Python 3.12+ splits f-strings
            out.append((tok.start[0], tok.string))
    return out


def test_only_the_families_package_names_a_family() -> None:
    offenders = []
    for name, path in modules().items():
        if name.startswith("imglora.families"):
            continue
        offenders += [f"{path.relative_to(PKG)}:{line}: {text}" for line, text in code_tokens(path)
                      if FAMILY_NAMES.search(NOT_FAMILY_NAMES.sub("", text))]
    assert offenders == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_is_longer_than_500_lines(name: str) -> None:
    lines = modules()[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines"
