"""The package layout the README's "Development" map describes: module sizes, who may import whom, private
internals only in compat, the length of the minGPT reading path."""

from __future__ import annotations

import ast
import sys
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


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_is_at_most_400_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 400


@pytest.mark.parametrize("path", sorted((PACKAGE / "models").rglob("*.py")), ids=lambda p: p.name)
def test_models_import_only_torch(path: Path) -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for name in imported_modules(path):
        top = name.split(".")[0]
        assert top in stdlib or top == "torch" or name.startswith("lit_ddp.models"), f"{path.name} imports {name}"


TUTORIAL = ("models", "data", "tasks", "recipe.py")
"""What a learner reads from a YAML to the tensor: it never imports the machinery."""
MACHINERY = ("lit_ddp.resilience", "lit_ddp.launch", "lit_ddp.compat", "lit_ddp.cli")


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


def test_cli_reaches_the_machinery_through_one_door() -> None:
    """cli.py takes the resilience layer as one class (ResilientCLI) and nothing else from it."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    from_resilience = [
        (node.module, [a.name for a in node.names])
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lit_ddp.resilience")
    ]
    assert from_resilience == [("lit_ddp.resilience", ["ResilientCLI"])]


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
