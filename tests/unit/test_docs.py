"""Every page is true on a fresh clone (issue 64): the README, every ``docs/*.md`` and every ``*/README.md``
(``slurm/README.md``, ``bench/README.md``), including pages added later, with no edit here.

On each page, in its code (inline spans and fenced blocks):

- every repository path it names exists (a glob matches something; ``tests/x.py::test_name`` names a test of that
  file; ``git show COMMIT:path`` names a file of that commit);
- every ``make`` target it names is a target of the Makefile;
- every ``python -m X`` / ``torchrun ... -m X`` module is importable;
- every dotted name of the project (``lit_ddp.x.Y``, ``bench.x``, ``examples.x.Y``) resolves;
- every config key it names (``trainer.strategy.init_args.sync_buffers``, ``--checkpoint.every_n_train_steps``, the
  keys of a YAML block) exists: a section's own class (``trainer``: Lightning's ``Trainer``; ``checkpoint``,
  ``startup``, ...: the classes ``lit_ddp/cli.py`` adds), else the ``__init__`` of a class a shipped YAML names at
  that place (``model``, ``data``, ``trainer.strategy``: its ``class_path``);
- every YAML block headed by a file of the checkout (``# configs/regression/ddp.yaml``) is that file's: each
  top-level section it shows equals the file's, whole; a block headed ``# F: as G.yaml, but`` shows exactly the
  leaves where F differs from G, with F's values.

In its prose: every relative link names a file of the checkout, and every ``#anchor`` a heading of the page it
points to (GitHub's slugs). And every citation of a page in the code, the configs and the scripts
(``docs/speed.md, "On one GPU"``, ``slurm/README.md#several-nodes``) names a page that exists and one of its
headings.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import REPO

PAGES = sorted({REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("*/README.md")})
PAGE_IDS = [str(p.relative_to(REPO)) for p in PAGES]
BIN = Path(sys.executable).parent
# What the checkout's code, configs and scripts cite pages from.
CITING = ["lit_ddp/**/*.py", "bench/**/*.py", "tests/**/*.py", "scripts/**/*.py", "examples/**/*.py",
          "configs/**/*.yaml", "examples/**/*.yaml", "slurm/*", "Makefile", "pyproject.toml"]  # fmt: skip
# Fenced blocks of these languages hold what a reader types or a file holds; the others (``text``, none) what a
# command printed once (paths are checked there too), or a diagram (``mermaid``: nothing is).
TYPED = {"bash", "sh", "shell", "console", "yaml", "python", "toml"}
NOT_CODE = {"mermaid"}
FILE_SUFFIXES = (".py", ".yaml", ".yml", ".md", ".ckpt", ".json", ".txt", ".pt", ".out", ".log", ".sh", ".sbatch",
                 ".pkl", ".gz")  # fmt: skip


# --- reading a page ---------------------------------------------------------------------------------------------


@cache
def split(page: Path) -> tuple[list[tuple[str, str]], str]:
    """The page's fenced blocks as (language, body), and its prose: the text without them."""
    text = page.read_text()
    fences = [(m[2], m[3]) for m in re.finditer(r"^(`{3,}|~{3,})[ \t]*(\w*)[^\n]*\n(.*?)^\1[ \t]*$", text, re.M | re.S)]
    prose = re.sub(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1[ \t]*$", "", text, flags=re.M | re.S)
    return fences, prose


def spans(prose: str) -> list[str]:
    """The inline code spans of ``prose`` (a span may wrap a line, not a paragraph), whitespace folded."""
    found = []
    for m in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, re.S):
        if "\n\n" not in m[2]:
            found.append(re.sub(r"\s*\n\s*", " ", m[2]).strip())
    return found


@cache
def code(page: Path, printed: bool = False) -> list[str]:
    """The page's code: each inline span, and each line of each fenced block a reader types or a file holds (a line
    ending in ``\\`` joined with the next, as a shell reads it); ``printed``: of the output blocks too."""
    fences, prose = split(page)
    found = spans(prose)
    for language, body in fences:
        if language in TYPED or (printed and language not in NOT_CODE):
            found += body.replace("\\\n", " ").splitlines()
    return found


def commands(snippet: str) -> Iterator[list[str]]:
    """The simple commands of a line of shell: its words, split at ``;``, ``&&``, ``||``, ``|``, ``&`` and ``(``."""
    for part in re.split(r"&&|\|\||[;|&()]|\$\(", snippet):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            words = part.split()
        while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):  # NAME=VALUE before the program
            words = words[1:]
        if words:
            yield words


def headings(page: Path) -> list[str]:
    """The page's headings, as text (inline code's backticks and links' targets removed)."""
    _, prose = split(page)
    found = []
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", prose, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        found.append(heading.replace("`", "").strip())
    return found


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, every character but letters, digits, ``_``, ``-`` and spaces
    dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated one gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in headings(page):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


# --- what the checkout holds ------------------------------------------------------------------------------------


@cache
def tracked_top_level() -> tuple[str, ...]:
    """The checkout's top-level directories (those holding a tracked file, or every one outside a git checkout)."""
    try:
        files = subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
        names = {f.split("/", 1)[0] for f in files if "/" in f}
    except (OSError, subprocess.CalledProcessError):
        names = {p.name for p in REPO.iterdir() if p.is_dir() and p.name not in (".git", ".venv", "runs")}
    return tuple(sorted(names, key=len, reverse=True))


def path_pattern() -> re.Pattern[str]:
    roots = "|".join(re.escape(n) for n in tracked_top_level())
    return re.compile(rf"(?<![\w./:~$<>-])((?:{roots})/[\w./*{{}}<>=-]*[\w*}}])(::[\w:\[\]-]+)?")


def path_problem(path: str, test: str | None) -> str | None:
    """Why ``path`` (a repository path, maybe a glob; ``test``: ``::name`` after it) names nothing, else None."""
    if "<" in path or "{" in path:
        return None  # a placeholder (<run dir>, {rank}): no path of the checkout
    if "*" in path:
        return None if any(REPO.glob(path)) else f"{path}: matches no file"
    file = REPO / path
    if not file.exists():
        return f"{path}: no such file"
    if test:
        name = re.sub(r"\[.*\]$", "", test.rsplit("::", 1)[-1])
        if not re.search(rf"^\s*(?:async )?(?:def|class) {re.escape(name)}\b", file.read_text(), re.M):
            return f"{path}{test}: no test {name} in {path}"
    return None


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def git_has(commit: str, path: str) -> bool:
    """Whether ``path`` is a file of ``commit``; True where the checkout cannot say (a shallow clone lacking the
    commit, no git)."""
    try:
        if git("cat-file", "-e", f"{commit}:{path}").returncode == 0:
            return True
        return git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0 and (
            git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        )
    except OSError:
        return True


@cache
def make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+)[ \t]*:(?!=)", makefile, re.M))
    for phony in re.findall(r"^\.PHONY:(.*(?:\\\n.*)*)", makefile, re.M):
        targets |= set(phony.replace("\\\n", " ").split())
    return targets


def resolves(name: str) -> bool:
    """Whether the dotted ``name`` is a module of the checkout or an attribute chain of one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(module)
        except ImportError:
            continue
        try:
            for attribute in parts[i:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False
        return True
    return False


# --- config keys ------------------------------------------------------------------------------------------------


@cache
def section_classes() -> dict[str, type]:
    """The CLI's sections whose class is fixed: ``trainer`` and those ``lit_ddp/cli.py`` adds with
    ``add_lightning_class_args(Class, "section")``."""
    import lightning.pytorch as pl

    import lit_ddp.cli

    found: dict[str, type] = {"trainer": pl.Trainer}
    source = inspect.getsource(lit_ddp.cli)
    for name, section in re.findall(r"add_lightning_class_args\((\w+),\s*\"(\w+)\"\)", source):
        found[section] = getattr(lit_ddp.cli, name)
    return found


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A YAML mapping's leaves by dotted key (a list is a leaf)."""
    if isinstance(value, dict) and value:
        leaves: dict[str, Any] = {}
        for key, item in value.items():
            leaves |= flatten(item, f"{prefix}.{key}" if prefix else str(key))
        return leaves
    return {prefix: value}


@cache
def shipped_class_paths() -> dict[str, frozenset[str]]:
    """Every ``class_path`` the shipped YAMLs name, by the dotted key of the mapping that holds it
    (``trainer.strategy``: the strategies; ``model``: the LightningModules)."""
    found: dict[str, set[str]] = {}
    for path in [*REPO.glob("configs/**/*.yaml"), *REPO.glob("examples/**/*.yaml")]:
        for key, value in flatten(yaml.safe_load(path.read_text()) or {}).items():
            if key.endswith(".class_path"):
                found.setdefault(key.removesuffix(".class_path"), set()).add(value)
    return {k: frozenset(v) for k, v in found.items()}


def init_parameters(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes: its ``__init__``'s, and its bases' while one passes ``**kwargs`` on.
    (Not what Lightning's ``DDPStrategy`` passes on to ``DistributedDataParallel``: lit-ddp's refuses some.)"""
    names: set[str] = set()
    for base in cls.__mro__:
        if "__init__" not in vars(base) or base is object:
            continue
        params = inspect.signature(base.__init__).parameters
        names |= {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return names
    return names


def import_class(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def key_problem(key: str, class_paths: dict[str, set[str]] | None = None) -> str | None:
    """Why the config key ``key`` (``trainer.strategy.init_args.sync_buffers``) does not exist, else None.
    ``class_paths``: those a YAML block names beside the key, by the key of the mapping that holds them."""
    parts = key.split(".")
    fixed = section_classes()
    if parts[0] not in fixed and parts[0] not in ("model", "data"):
        return None  # not a section of the CLI
    if len(parts) == 1:
        return None
    at, rest = parts[0], parts[1:]
    if at in fixed:  # the section's own argument, or a public attribute of its class (trainer.fit)
        cls = fixed[at]
        if rest[0] not in init_parameters(cls) and (rest[0].startswith("_") or not hasattr(cls, rest[0])):
            return f"{key}: {cls.__name__} has no argument {rest[0]}"
        at, rest = f"{at}.{rest[0]}", rest[1:]
    while rest:  # a class_path / init_args pair below a key that takes a class
        if rest[0] in ("class_path", "dict_kwargs"):
            return None
        if rest[0] != "init_args" or len(rest) < 2:
            return f"{key}: {at} takes class_path and init_args, not {rest[0]}"
        named = set(shipped_class_paths().get(at, ())) | set((class_paths or {}).get(at, ()))
        classes = [c for c in (import_class(p) for p in named) if c is not None]
        if not classes:
            return None if named else f"{key}: no shipped YAML names a class_path for {at}"
        if not any(rest[1] in init_parameters(c) for c in classes):
            return f"{key}: none of {sorted(c.__name__ for c in classes)} takes {rest[1]}"
        at, rest = f"{at}.init_args.{rest[1]}", rest[2:]
    return None


@cache
def known_names() -> frozenset[str]:
    """Every key a shipped YAML holds, at any level, and every argument of a class a section or a shipped YAML
    names: what a span ``name: value`` may call a key."""
    names: set[str] = set()
    for path in [*REPO.glob("configs/**/*.yaml"), *REPO.glob("examples/**/*.yaml")]:
        for key in flatten(yaml.safe_load(path.read_text()) or {}):
            names |= set(key.split("."))
    classes = [*section_classes().values(), *(import_class(p) for ps in shipped_class_paths().values() for p in ps)]
    for cls in classes:
        if cls is not None:
            names |= init_parameters(cls)
    return frozenset(names)


# A YAML leaf in prose: ``sync_buffers: false``, ``monitor: step`` (one word of a value; a log line has more).
LEAF_SPAN = re.compile(r"([a-z_][a-z0-9_]*): ([\w.+:-]+|\[[^\]]*\]|\"[^\"]*\")")


def key_pattern() -> re.Pattern[str]:
    sections = "|".join(sorted({*section_classes(), "model", "data"}, key=len, reverse=True))
    return re.compile(rf"(?<![\w./$-])(?:--)?((?:{sections})(?:\.[A-Za-z_]\w*)+)(?![\w(/-])")


# --- the checks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_paths_named_exist(page: Path) -> None:
    pattern = path_pattern()
    problems = []
    for snippet in code(page, printed=True):
        for commit, path in re.findall(r"\b([0-9a-f]{7,40}):([\w./-]+)", snippet):
            if not git_has(commit, path):
                problems.append(f"{commit}:{path}: not a file of that commit")
        for m in pattern.finditer(snippet):
            if (problem := path_problem(m[1], m[2])) is not None:
                problems.append(problem)
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(dict.fromkeys(problems))


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_make_targets_named_exist(page: Path) -> None:
    problems = []
    for snippet in code(page):
        for words in commands(snippet):
            if Path(words[0]).name != "make":
                continue
            targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            problems += [f"make {t}: no such target in the Makefile" for t in targets[:1] if t not in make_targets()]
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(dict.fromkeys(problems))


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_modules_named_exist(page: Path) -> None:
    """``python -m X`` (and ``torchrun ... -m X``): X is importable from the checkout's environment; a program
    ``.venv/bin/X`` is one of the environment's."""
    problems = []
    for snippet in code(page):
        for words in commands(snippet):
            program = Path(words[0]).name
            if words[0].startswith(".venv/bin/") and not (BIN / program).exists():
                problems.append(f"{words[0]}: no such program in the environment")
            if (re.fullmatch(r"python[\d.]*|torchrun|\$\{?PYTHON\}?", program) or "$(BIN)/python" in words[0]) and (
                "-m" in words[:-1]
            ):
                module = words[words.index("-m") + 1]
                if importlib.util.find_spec(module) is None:
                    problems.append(f"python -m {module}: no such module")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(dict.fromkeys(problems))


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_python_names_resolve(page: Path) -> None:
    """Every dotted name of the project's packages (``lit_ddp.strategies.DDPStrategy``) is a module or an attribute."""
    problems = []
    for snippet in code(page):
        for name in re.findall(r"(?<![\w./:-])((?:lit_ddp|bench|examples)(?:\.[A-Za-z_]\w*)+)", snippet):
            if not name.endswith(FILE_SUFFIXES) and not resolves(name):
                problems.append(f"{name}: no such module or attribute")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(dict.fromkeys(problems))


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_config_keys_named_exist(page: Path) -> None:
    """Every config key in the page's code, every key of its YAML blocks, and every key of a YAML leaf in prose."""
    pattern = key_pattern()
    problems = []
    for snippet in code(page):
        for key in pattern.findall(snippet):
            if not key.endswith(FILE_SUFFIXES) and (problem := key_problem(key)) is not None:
                problems.append(problem)
    for span in spans(split(page)[1]):
        if (leaf := LEAF_SPAN.fullmatch(span)) is not None and leaf[1] not in known_names():
            problems.append(f"{span}: no shipped YAML nor class of a section takes a key {leaf[1]}")
    fences, _ = split(page)
    for language, body in fences:
        if language != "yaml":
            continue
        leaves = flatten(yaml.safe_load(body) or {})
        named = {k.removesuffix(".class_path"): {v} for k, v in leaves.items() if k.endswith(".class_path")}
        for key in leaves:
            if (problem := key_problem(key, named)) is not None:
                problems.append(f"yaml block: {problem}")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(dict.fromkeys(problems))


def excerpt_problems(page: Path, body: str) -> list[str]:
    """What a YAML block headed by a file of the checkout misstates about it."""
    header = re.match(r"#\s*(\S+?\.ya?ml)\b(.*)", body)
    if header is None or header[1].startswith("/") or not (REPO / header[1]).parent.exists():
        return []  # not headed by a file of the checkout (a user's /shared/my_project/train.yaml)
    name, rest = header[1], header[2]
    file = REPO / name
    if not file.is_file():
        return [f"{name}: no such file"]
    shown, whole = yaml.safe_load(body) or {}, yaml.safe_load(file.read_text()) or {}
    if not isinstance(shown, dict):
        return [f"{name}: the excerpt is not a mapping"]
    base = re.search(r"as (\S+?\.ya?ml),? but", rest)
    if base is None:
        return [
            f"{name}: the excerpt's {key} is not the file's (shown {shown[key]!r}, file {whole.get(key)!r})"
            for key in shown
            if shown[key] != whole.get(key)
        ]
    base_file = file.parent / base[1]
    if not base_file.is_file():
        return [f"{name}: the excerpt's base {base[1]} is no file beside it"]
    differs = flatten(whole)
    base_leaves = flatten(yaml.safe_load(base_file.read_text()) or {})
    differs = {k: v for k, v in differs.items() if base_leaves.get(k, object()) != v}
    shown_leaves = flatten(shown)
    problems = [f"{name}: shows {k}: {v!r}, the file has {flatten(whole).get(k)!r}" for k, v in shown_leaves.items()
                if k not in differs or differs[k] != v]  # fmt: skip
    problems += [f"{name}: differs from {base[1]} in {k} ({v!r}), which the excerpt omits"
                 for k, v in differs.items() if k not in shown_leaves]  # fmt: skip
    return problems


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_yaml_excerpts_are_their_files(page: Path) -> None:
    """A YAML block whose first line names a file (``# configs/regression/ddp.yaml``) shows whole top-level sections
    of it, as they are there; one headed ``as G.yaml, but`` shows exactly where the file differs from G."""
    fences, _ = split(page)
    problems = [p for language, body in fences if language == "yaml" for p in excerpt_problems(page, body)]
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=PAGE_IDS)
def test_links_and_anchors_resolve(page: Path) -> None:
    """Every relative link names a file of the checkout, and an anchor one of that page's headings."""
    _, prose = split(page)
    prose = re.sub(r"(?<!`)(`+)(?!`).+?(?<!`)\1(?!`)", "", prose, flags=re.S)  # code spans hold no links
    problems = []
    for target in re.findall(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)", prose):
        if re.match(r"[a-z][\w+.-]*:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not problems, f"{page.relative_to(REPO)}:\n" + "\n".join(problems)


CITATION = re.compile(
    r"((?:docs|slurm|bench)/[\w-]+\.md|README\.md)"  # the page
    r"(?:#([\w-]+)|,? \(?\"((?:[^\"\n]|\n[ \t]*#?[ \t]*)+?)\")?"  # and an anchor, or a heading in quotes
)


def citations() -> Iterator[tuple[str, str, str | None, str | None]]:
    """(file, page, anchor, heading) for each page the checkout's code, configs and scripts cite."""
    for pattern in CITING:
        for file in sorted(REPO.glob(pattern)):
            if not file.is_file() or file.suffix in (".pyc", ".ckpt"):
                continue
            text = file.read_text(errors="replace")
            for m in CITATION.finditer(text):
                heading = re.sub(r"\s*\n[ \t]*#?[ \t]*", " ", m[3]) if m[3] else None
                yield str(file.relative_to(REPO)), m[1], m[2], heading


def test_code_cites_pages_and_headings_that_exist() -> None:
    """``docs/fault_tolerance.md, "Atomic saves"`` in a docstring names a page and the start of one of its
    headings; ``slurm/README.md#several-nodes`` one of its anchors."""
    problems = []
    for file, name, anchor, heading in citations():
        page = REPO / name
        if not page.is_file():
            problems.append(f"{file}: cites {name}, which does not exist")
        elif anchor and anchor not in anchors(page):
            problems.append(f"{file}: cites {name}#{anchor}: no such heading")
        elif heading and not any(h.startswith(heading.replace("`", "")) for h in headings(page)):
            problems.append(f'{file}: cites {name}, "{heading}": no heading starts so')
    assert not problems, "\n".join(dict.fromkeys(problems))
