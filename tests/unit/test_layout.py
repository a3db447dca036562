"""The package layout the README's "Development" map describes: who may import whom, private
internals only in compat, the length of the minGPT reading path."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import PACKAGE, REPO

MODULES = sorted(PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports (absolute imports; the package uses no others)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from lit_ddp import compat`
    return names


COMPAT_CONCERNS = {"loops", "checkpoints", "strategies", "logging", "signals", "torch", "muon", "imports", "torchft"}


def test_compat_is_one_module_per_thing_it_patches() -> None:
    """compat's modules are the concerns its docstring lists (Lightning's loop, checkpointing, strategies, logging,
    signals; torch's own and its Muon; the import helper), and the rest of the package reaches them through ``lit_ddp.compat``
    only: a workaround moves between modules without touching its callers."""
    compat = PACKAGE / "compat"
    assert {p.stem for p in compat.glob("*.py")} - {"__init__"} == COMPAT_CONCERNS
    direct = [
        f"{path.relative_to(REPO)}: {name}"
        for path in MODULES
        if path.parent != compat
        for name in imported_modules(path)
        if name.startswith("lit_ddp.compat.")
    ]
    assert direct == []


@pytest.mark.parametrize("path", sorted((PACKAGE / "models").rglob("*.py")), ids=lambda p: p.name)
def test_models_import_only_torch(path: Path) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name in imported_modules(path):
        top = name.split(".")[0]
        assert top in stdlib or top == "torch" or name.startswith("lit_ddp.models"), f"{path.name} imports {name}"


TUTORIAL = ("models", "data", "tasks", "recipe.py")
"""What a learner reads from a YAML to the tensor: it never imports the machinery."""
MACHINERY = (
    "lit_ddp.resilience",
    "lit_ddp.launch",
    "lit_ddp.compat",
    "lit_ddp.cli",
    "lit_ddp.run_dir",
    "lit_ddp.chaos",
    "lit_ddp.errors",
)


def tutorial_modules() -> list[Path]:
    return sorted(
        p for part in TUTORIAL for p in ([PACKAGE / part] if part.endswith(".py") else (PACKAGE / part).rglob("*.py"))
    )


@pytest.mark.parametrize("path", tutorial_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_tutorial_never_imports_the_machinery(path: Path) -> None:
    for name in imported_modules(path):
        assert not name.startswith(MACHINERY), f"{path.name} imports {name}"


def test_recipe_is_lightning_free() -> None:
    for name in imported_modules(PACKAGE / "recipe.py"):
        assert not name.startswith(("lightning", "pytorch_lightning")), name


@pytest.mark.parametrize("path", sorted((PACKAGE / "data").rglob("*.py")), ids=lambda p: p.name)
def test_data_never_imports_tasks(path: Path) -> None:
    for name in imported_modules(path):
        assert not name.startswith(("lit_ddp.tasks", "lit_ddp.callbacks")), f"{path.name}: {name}"


def test_the_command_is_one_cli_class() -> None:
    """Every hook of the ``lit-ddp`` command is in one class, cli.py's ``LitDDPCLI``: no other class of the package
    derives from LightningCLI (two classes that both override the same hooks split one concept)."""
    from lightning.pytorch.cli import LightningCLI

    for path in MODULES:
        importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"))

    def subclasses(cls: type) -> list[type]:
        return [s for sub in cls.__subclasses__() for s in (sub, *subclasses(sub))]

    ours = sorted(
        f"{c.__module__}.{c.__qualname__}" for c in subclasses(LightningCLI) if c.__module__.startswith("lit_ddp")
    )
    assert ours == ["lit_ddp.cli.LitDDPCLI"]


def private_accesses(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self``/``cls`` (dunders aside), and imports of ``_names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lit_ddp"):
            found += [
                f"{path.name}:{node.lineno} {a.name}"
                for a in node.names
                if a.name.startswith("_") and a.name != "__future__"
            ]
            if any(part.startswith("_") and not part.startswith("__") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno} {node.module}")
    return found


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.parent != PACKAGE / "compat"], ids=lambda p: str(p.relative_to(REPO))
)
def test_private_internals_only_in_compat(path: Path) -> None:
    assert private_accesses(path) == []


def import_closure(*starts: Path) -> dict[Path, int]:
    """Lines of every package module reachable from ``starts`` through ``lit_ddp`` imports (a package import
    runs its ``__init__``): what a reader opens to follow the code."""
    seen: dict[Path, int] = {}
    todo = list(starts)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = len(path.read_text().splitlines())
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] != "lit_ddp":
                continue
            for i in range(1, len(parts) + 1):
                base = REPO.joinpath(*parts[:i])
                todo += [p for p in (base / "__init__.py", base.with_suffix(".py")) if p.exists()]
    return seen


def test_the_minGPT_tutorial_modules_are_at_most_1000_lines() -> None:
    """What a reader opens to follow `make train` from its YAMLs to the tensor entering GPT.forward: the data
    module, the task and the model with every package module they import (the recipe too, which the task's
    ``configure_optimizers`` calls). README "Development" quotes the numbers; the YAMLs are printed apart."""
    yamls = [REPO / "configs" / "trainer" / "ddp.yaml", REPO / "configs" / "mingpt" / "cpu.yaml"]
    closure = import_closure(
        PACKAGE / "data" / "char.py", PACKAGE / "tasks" / "mingpt.py", PACKAGE / "models" / "gpt.py"
    )
    total = sum(closure.values())
    print(
        f"tutorial modules {total} lines ({', '.join(f'{p.relative_to(PACKAGE)} {n}' for p, n in sorted(closure.items()))}); "
        f"the two YAMLs {sum(len(y.read_text().splitlines()) for y in yamls)} lines"
    )
    assert total <= 1000


def graph_nodes() -> set[str]:
    """lit_ddp's packages and top-level modules, as dotted names: ``lit_ddp.launch``, ``lit_ddp.cli``, ..."""
    return {
        f"lit_ddp.{p.stem if p.is_file() else p.name}"
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }


def node_of(path_or_name: Path | str, nodes: set[str]) -> str | None:
    """The package or top-level module a file (a path) or an imported name (dotted) belongs to; None for the
    package's own ``__init__`` and names outside lit_ddp."""
    if isinstance(path_or_name, Path):
        parts = ["lit_ddp", *path_or_name.relative_to(PACKAGE).with_suffix("").parts]
    else:
        parts = path_or_name.split(".")
    name = ".".join(parts[:2])
    return name if parts[0] == "lit_ddp" and name in nodes else None


def import_graph() -> dict[str, set[str]]:
    """Who imports whom among :func:`graph_nodes`, from every ``import`` in the source (inside functions too)."""
    nodes = graph_nodes()
    graph: dict[str, set[str]] = {node: set() for node in nodes}
    for path in MODULES:
        source = node_of(path, nodes)
        if source is None:
            continue
        for name in imported_modules(path):
            target = node_of(name, nodes)
            if target is not None and target != source:
                graph[source].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_package_uses_absolute_imports_only() -> None:
    """What :func:`imported_modules` reads: a relative import would hide an edge of the import graph."""
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{path.relative_to(REPO)}:{node.lineno}"


def test_find_cycle_names_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_packages_and_top_level_modules_import_each_other_one_way() -> None:
    """The import graph of lit_ddp's packages and top-level modules has no cycle: each layer can be read, tested and
    replaced knowing only those below it. The message names a cycle."""
    graph = import_graph()
    print("\n".join(f"{node} -> {', '.join(sorted(targets))}" for node, targets in sorted(graph.items()) if targets))
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_run_directory_imports_only_the_bottom_layers() -> None:
    """``lit_ddp.run_dir`` is a leaf: every layer may use it, and it uses none of them but the errors and compat."""
    assert import_graph()["lit_ddp.run_dir"] <= {"lit_ddp.errors", "lit_ddp.compat"}


def test_the_errors_and_compat_import_nothing_of_the_package() -> None:
    graph = import_graph()
    assert graph["lit_ddp.errors"] == set()
    assert graph["lit_ddp.compat"] == set()


def test_tools_users_run_are_imported_by_nobody() -> None:
    """``chaos`` sits on top: nothing imports it; the ``lit-ddp`` command (:mod:`lit_ddp.cli`) reaches it by name,
    as a subcommand, only when it is asked for (``lit_ddp.cli.TOOLS``)."""
    from lit_ddp.cli import TOOLS

    assert {node for node, targets in import_graph().items() if "lit_ddp.chaos" in targets} == set()
    assert TOOLS["chaos"][0] == "lit_ddp.chaos.cli"


LAYOUT_STRINGS = re.compile(r"(^|/)(checkpoints|set_aside)($|/)|last\.ckpt|hpc_ckpt|\.lit_ddp\.(lock|holder)")
"""How a run directory's entries are spelled (:mod:`lit_ddp.run_dir.layout`)."""


def code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module's code (f-strings' literal parts too), docstrings left out."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_run_directory_layout_is_spelled_in_one_module(path: Path) -> None:
    """``checkpoints/``, ``last.ckpt``, ``hpc_ckpt_N.ckpt``, ``set_aside/`` and the lock's files are named in
    :mod:`lit_ddp.run_dir.layout` only; everything else builds their paths from it."""
    if path == PACKAGE / "run_dir" / "layout.py":
        return
    spelled = [f"{path.name}:{line} {value!r}" for line, value in code_strings(path) if LAYOUT_STRINGS.search(value)]
    assert spelled == []


def self_privates(cls: type) -> set[str]:
    """``_names`` (dunders aside) that ``cls``'s own source reads or writes on ``self``/``cls``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # a builtin or generated class: what it defines is all there is
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("self", "cls")
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    }


def inherited_privates(cls: type) -> list[str]:
    """The ``self._x`` of ``cls``'s own source, and the ``_x`` methods it overrides, that a base from another
    library defines or uses: that base's private state and methods, which only compat may touch."""
    foreign = [b for b in cls.__mro__[1:] if not b.__module__.startswith("lit_ddp") and b is not object]
    theirs = set().union(*(set(vars(b)) | self_privates(b) for b in foreign)) if foreign else set()
    own = {n for n in vars(cls) if n.startswith("_") and not n.startswith("__") and n != "_abc_impl"}  # abc's
    return sorted(f"{cls.__qualname__}.{name}" for name in (self_privates(cls) | own) & theirs)


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.parent != PACKAGE / "compat"], ids=lambda p: str(p.relative_to(REPO))
)
def test_no_inherited_private_state_outside_compat(path: Path) -> None:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    module = importlib.import_module(name)
    classes = [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == name]
    assert [found for cls in classes for found in inherited_privates(cls)] == []


def test_inherited_privates_finds_a_base_s_private_state() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Swapping(ModelCheckpoint):
        def swap(self) -> None:
            self._every_n_train_steps, self._own = 1, 2

        def _save_last_checkpoint(self, *args: object) -> None: ...

    name = Swapping.__qualname__
    assert inherited_privates(Swapping) == [f"{name}._every_n_train_steps", f"{name}._save_last_checkpoint"]
