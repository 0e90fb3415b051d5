"""The package's shape: every concern in its folder, the folders in layers that import only their own
layer or lower (no cycle, no command imported by the core), only ``families/`` knows a family by
name, and the package root holds at most five modules. (Modules of more than about 500 lines are a
review question, not a rule: splitting a file only to stay under a count spreads one concern.)"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path


PKG = Path(__file__).resolve().parents[1] / "src" / "imglora"
MAX_ROOT_MODULES = 5

# Lowest first. A module may import modules of its own layer or of a lower one; imports made only for
# type annotations (under ``if TYPE_CHECKING:``) are not counted (they run nothing).
LAYERS: list[tuple[str, ...]] = [
    ("imglora.errors", "imglora.util"),  # exceptions and small helpers
    ("imglora.config",),                 # the typed config (no torch)
    ("imglora.runs",),                   # what a run leaves behind: record, log, telemetry, costs
    ("imglora.family",),                 # the protocols a family implements
    ("imglora.models",),                 # where weights come from
    ("imglora.data",),                   # datasets and the content-keyed cache
    ("imglora.adapters",),               # LoRA and the other adapter types
    ("imglora.memory",),                 # fp8, block swap, offload: wrappers that know no family
    ("imglora.plan",),                   # memory and time before a GPU is rented
    ("imglora.training",),               # the trainer, one update, checkpoints, optimizers
    ("imglora.export",),                 # the ComfyUI writer and workflows
    ("imglora.families",),               # one folder per family, behind the registry
    ("imglora.commands",),               # one function per command
    ("imglora.ui",),                     # the web UI (a front end)
    ("imglora.cli", "imglora.__main__", "imglora"),  # the command line
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str], runtime_only: bool = False) -> set[str]:
    """Every imglora module ``name`` imports, at any depth (function-level imports included), plus
    the packages importing it executes (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``),
    except the packages ``name`` itself lies in (they are already being imported when it runs)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in walk(tree, runtime_only):
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


def walk(tree: ast.AST, runtime_only: bool) -> list[ast.AST]:
    """Every node of ``tree``; with ``runtime_only``, not those under ``if TYPE_CHECKING:``."""
    out, todo = [], [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if runtime_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return out


def graph(runtime_only: bool = False) -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods), runtime_only) for name, path in mods.items()}


def layer(module: str) -> int:
    """The layer of ``module``: that of the longest LAYERS prefix naming it."""
    found = [(len(p), i) for i, names in enumerate(LAYERS) for p in names if module == p or module.startswith(p + ".")]
    assert found, f"{module} is in no layer: add its folder to LAYERS"
    return max(found)[1]


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
            ("imglora.cli", "imglora.__main__")]
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


def test_each_layer_imports_only_its_own_or_lower_layers() -> None:
    g = graph(runtime_only=True)
    upward = [f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
              for m, deps in sorted(g.items()) for d in sorted(deps) if d != "imglora" and layer(d) > layer(m)]
    assert upward == []


def test_the_layer_rule_catches_an_upward_import(tmp_path) -> None:
    """The rule above is not vacuous: the core importing a command, or the config the training, is caught."""
    known = set(modules())
    for name, text, target in [("imglora.plan.predict", "from ..commands import bench\n", "imglora.commands.bench"),
                               ("imglora.config.checks", "from ..training import optimizers\n",
                                "imglora.training.optimizers"),
                               ("imglora.family", "if TYPE_CHECKING:\n    from .data import samples\n", None)]:
        f = tmp_path / "m.py"
        f.write_text(text)
        found = imports(name, f, known, runtime_only=True)
        if target is None:
            assert found == set()  # annotations only
        else:
            assert target in found and layer(target) > layer(name)


def test_the_package_root_holds_at_most_five_modules() -> None:
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root
    assert {"cli.py", "family.py", "__init__.py"} <= set(root)
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["adapters", "commands", "config", "data", "export", "families", "memory", "models", "plan",
                       "runs", "training", "ui", "util"]
    for folder in folders:  # every folder is in a layer
        layer(f"imglora.{folder}")


def declared_family_attributes() -> set[str]:
    """Every member of family.py's protocols, and the optional attributes of ``family.OPTIONS``."""
    from imglora.family import OPTIONS

    tree = ast.parse((PKG / "family.py").read_text())
    out = set(OPTIONS)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any("Protocol" in ast.unparse(b) for b in node.bases):
            out |= {i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
            out |= {i.name for i in node.body if isinstance(i, ast.FunctionDef)}
    return out


def undeclared_family_reads(source: str, declared: set[str]) -> list[str]:
    """``family.X``, ``getattr(family, "X", ...)``, ``hasattr(family, "X")`` and ``option(family, "X")``
    (also on ``self.family`` and ``fam``) whose X is declared nowhere."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "option") and len(node.args) >= 2:
            owner, name = ast.unparse(node.args[0]), node.args[1]
            if ("family" in owner or owner == "fam") and isinstance(name, ast.Constant) and name.value not in declared:
                out.append(f"{node.lineno}: {node.func.id}({owner}, {name.value!r})")
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("family", "self.family", "fam") and \
                node.attr not in declared:
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_core_reads_only_family_attributes_a_protocol_or_options_declares() -> None:
    """A new family is a copy of the template: what the core may read of it is written down in one
    place (family.py), never found by reading the core."""
    declared = declared_family_attributes()
    assert {"compile_blocks", "loss_units", "control_images", "swap_counts", "export_tensors"} <= declared
    found = [f"{path.relative_to(PKG)}:{x}" for name, path in modules().items()
             if not name.startswith("imglora.families") for x in undeclared_family_reads(path.read_text(), declared)]
    assert found == []
    planted = 'def f(family):\n    return getattr(family, "secret_knob", 0), family.other, hasattr(fam, "x")\n'
    assert undeclared_family_reads(planted, declared) == [
        "2: getattr(family, 'secret_knob')", "2: family.other", "2: hasattr(fam, 'x')"]


def test_only_an_adapter_types_own_file_names_it() -> None:
    """An adapter type touches one file, ``adapters/<type>.py``: no other module compares a value with
    its name (the config schema's torch-free list of names excepted, which must equal the registry).
    "lora" is left out: it is also the [lora] section's name."""
    import typing

    from imglora.adapters import KINDS
    from imglora.config.schema import AdapterType

    assert typing.get_args(AdapterType) == tuple(KINDS), "config.schema.AdapterType must list imglora.adapters.KINDS"
    names = set(KINDS) - {"lora"}
    allowed = {f"imglora.adapters.{n}" for n in KINDS} | {"imglora.config.schema"}
    found = []
    for name, path in modules().items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PKG)}:{node.lineno} {node.value!r}")
    assert not found, "adapter types named outside their own file:\n" + "\n".join(found)


def family_calls(source: str, method: str) -> list[int]:
    """Lines calling ``<family>.method(...)`` (on ``family``, ``self.family`` or ``fam``)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
            and ast.unparse(node.func.value) in ("family", "self.family", "fam")]


def test_swap_counts_are_resolved_in_one_place_and_passed_down_as_data() -> None:
    """The family's swap rule runs in memory.wrap.resolve_swap alone (called where a command starts);
    everything after it (the loader, apply_memory, the plan) takes the resulting SwapLayout."""
    found = {name: lines for name, path in modules().items() if not name.startswith("imglora.families")
             for lines in [family_calls(path.read_text(), "swap_counts")] if lines}
    assert found == {"imglora.memory.wrap": found.get("imglora.memory.wrap")} and len(found["imglora.memory.wrap"]) == 1
    assert family_calls("def f(family):\n    return family.swap_counts([2], cfg)\n", "swap_counts") == [2]
