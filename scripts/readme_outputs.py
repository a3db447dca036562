"""Runs the README's commands and writes what they print into its output blocks.

    .venv/bin/python scripts/readme_outputs.py                # every block (about 5 minutes on 2 cores)
    .venv/bin/python scripts/readme_outputs.py step1 step3    # the blocks named

In README.md an output block is a fenced ``text`` block right after an HTML comment ``<!-- output: NAME -->``; the
command that prints it is the one of the last fenced ``bash`` block before it (and after the output block before). Each command runs as a reader would run
it after ``make venv``: in a scratch directory that holds links to the checkout's ``configs/``, ``slurm/`` and
``.venv/`` (so ``runs/`` starts empty), through ``bash``, stdout and stderr merged; ``make T`` runs the command that
``make -n T`` prints (no ``make venv``, no network). What a terminal would show is kept: a progress bar's last
state (carriage returns and cursor moves resolved), absolute paths of the scratch directory made relative. A block
shows the lines :data:`SHOWN` picks, ``...`` where lines were left out.

Some blocks need more than the command (:data:`SPECIAL`): ``step3`` SIGKILLs rank 1 once the run has written its
step-200 checkpoint, as ``pkill -9`` from another terminal would (the fault-tolerant step's point is that the run
survives it); ``step4`` starts the same command twice on this machine, two torchrun agents as two nodes would, on a
free port in place of 29500, and shows the first agent's output; ``step5`` is the quick start's run (the same
command: ``make train``) and ``generate`` reads that run's checkpoint.

``tests/system/test_tutorial_page.py`` runs the same commands the same way and compares each block with the fresh
run's lines (:func:`differences`): text equal, integers equal, decimals within the tutorial page's tolerance,
the timings of a progress bar, ports, process ids and log time stamps left out, where the ``...`` fall left out,
and a text sample left out (a draw that another CPU's float rounding may change).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# What the scratch directory links to: what the commands read (configs, the sbatch scripts, the venv's programs).
LINKED = ("configs", "slurm", ".venv")
# Launcher variables the commands must not inherit from the caller (a test run under torchrun, a Slurm job).
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LIT_DDP_DATA")
TIMEOUT = 1200.0  # seconds a command may take (the minGPT run: about 2 minutes on 2 idle cores)
MARKER = re.compile(r"^<!-- output: (\w+) -->\n```text\n(.*?)^```\n", re.M | re.S)
FENCE = re.compile(r"^```bash\n(.*?)^```\n", re.M | re.S)
ELLIPSIS = "..."


@dataclass
class Block:
    """One output block of the README: its ``name``, the ``command`` before it, the ``shown`` lines, and where the
    block's text starts and ends in the README (``span``)."""

    name: str
    command: str
    shown: list[str]
    span: tuple[int, int]


def commands(fenced: str) -> list[str]:
    """The commands of a fenced bash block: comment lines dropped, ``\\``-continued lines joined."""
    joined, current = [], ""
    for line in fenced.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.strip()[:-1].rstrip() + " "
            continue
        joined.append((current + line.strip()).strip())
        current = ""
    return joined


def blocks(readme: str) -> list[Block]:
    """Every output block of ``readme`` (the README's text), in order, with the command of the last bash block
    between it and the output block before it.

    Raises:
        ValueError: a marker with no bash block of one command before it.
    """
    found: list[Block] = []
    previous = 0
    for match in MARKER.finditer(readme):
        fences = list(FENCE.finditer(readme, previous, match.start()))
        if not fences:
            raise ValueError(f"README: no bash block before the output block {match[1]!r}")
        cmds = commands(fences[-1][1])
        if len(cmds) != 1:
            raise ValueError(f"README: the bash block before {match[1]!r} holds {len(cmds)} commands, not one")
        found.append(Block(match[1], cmds[0], match[2].splitlines(), match.span(2)))
        previous = match.end()
    return found


def resolve(command: str) -> str:
    """``command``, with ``make TARGET`` replaced by what ``make -n TARGET`` prints (the checkout's Makefile, its
    venv taken as installed: no reinstall, no network), continued lines joined."""
    words = shlex.split(command)
    if words[0] != "make":
        return command
    bin_dir = REPO / ".venv" / "bin"
    # Under a parent make (`make test`), MAKELEVEL would have this one print "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "CONFIGS")}
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", f"{bin_dir}/.installed", *words[1:], f"BIN={bin_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if dry.returncode != 0:
        raise RuntimeError(f"make -n {' '.join(words[1:])} failed: {dry.stderr}")
    return " ".join(commands(dry.stdout)).replace(str(bin_dir), ".venv/bin")


def scratch_dir(parent: str | Path | None = None) -> Path:
    """A fresh directory holding links to what the commands read (:data:`LINKED`), as a clone after ``make venv``."""
    path = Path(tempfile.mkdtemp(prefix="readme-", dir=parent))
    for name in LINKED:
        (path / name).symlink_to(REPO / name)
    return path


# A progress bar's state that a message was printed after, on the same line (tqdm writes no newline of its own).
GLUED_BAR = re.compile(r"^[^\n]*?\|[^|\n]*\| *[\d?]+/[\d?]+ \[[^\]]*\](?=\S)")


def terminal_view(raw: str, scratch: Path) -> str:
    """What a terminal shows of ``raw`` output: each line's last carriage-return segment, no cursor moves, no
    progress bar left in front of a message, the scratch directory's and the checkout's paths relative."""
    raw = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", raw)
    lines = [GLUED_BAR.sub("", line.split("\r")[-1].rstrip()) for line in raw.split("\n")]
    text = "\n".join(lines).strip("\n")
    for path in {str(scratch.resolve()), str(scratch), str(REPO.resolve()), str((REPO / ".venv").resolve().parent)}:
        text = text.replace(path + "/", "")
    return text


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave as in a terminal
    return env


def start(command: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """Waits for ``proc`` and returns its output; its process group is killed either way."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args[-1]} exited with {proc.returncode}:\n{(out or '')[-3000:]}")
    return out


def worker(scratch: Path, rank: int) -> int | None:
    """The pid of the torchrun worker of ``rank`` whose working directory is ``scratch``, else None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if (
            cwd == str(scratch.resolve())
            and f"RANK={rank}".encode() in env
            and b"TORCHELASTIC_RUN_ID" in b" ".join(env)
        ):
            return int(entry.name)
    return None


def run_killing_rank_1(command: str, scratch: Path, step: int = 200) -> str:
    """Runs ``command``; once ``runs/*/*/checkpoints`` holds the checkpoint of ``step``, SIGKILLs rank 1."""
    proc = start(command, scratch, environment())
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    deadline = time.monotonic() + TIMEOUT
    while not list(scratch.glob(f"runs/*/*/checkpoints/*-step={step}.ckpt")):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{command}: no checkpoint of step {step}:\n{''.join(chunks)[-3000:]}")
        time.sleep(0.02)
    pid = worker(scratch, 1)
    if pid is None:
        raise RuntimeError(f"{command}: no worker of rank 1 found")
    os.kill(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} exited with {proc.returncode}:\n{''.join(chunks)[-3000:]}")
    return "".join(chunks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_agents(command: str, scratch: Path) -> str:
    """Runs ``command`` twice at once, two torchrun agents on this machine (node 0 at 127.0.0.1), the rendezvous on a
    free port in place of 29500; returns the output of the agent started first (rank 0's)."""
    command = command.replace(":29500", f":{free_port()}")
    first = start(command, scratch, environment())
    time.sleep(1.0)  # the agent started first hosts the rendezvous and becomes node 0
    second = start(command, scratch, environment())
    out = finish(first)
    finish(second)
    return out


def run(name: str, command: str, scratch: Path) -> str:
    """The terminal view of ``command`` (block ``name``) run in ``scratch`` (:data:`SPECIAL` for some)."""
    command = resolve(command)
    special = SPECIAL.get(name)
    raw = special(command, scratch) if special else finish(start(command, scratch, environment()))
    return terminal_view(raw, scratch)


SPECIAL: dict[str, Callable[[str, Path], str]] = {"step3": run_killing_rank_1, "step4": run_two_agents}
# Blocks shown from another block's run (the same command): the quick start's `make train` is step 5's command.
SAME_RUN = {"step5": "quickstart"}


def picker(*patterns: str, last: tuple[str, ...] = (), after: str | None = None) -> Callable[[list[str]], list[str]]:
    """A selection of lines: those matching any of ``patterns`` (regular expressions, searched), the last line
    matching each of ``last``, and every line from the first one equal to ``after`` on; in their order, ``...``
    where lines were left out between two shown ones."""

    def pick(lines: list[str]) -> list[str]:
        keep = {i for i, line in enumerate(lines) if any(re.search(p, line) for p in patterns)}
        for pattern in last:
            keep |= {max((i for i, line in enumerate(lines) if re.search(pattern, line)), default=-1)} - {-1}
        if after is not None and after in lines:
            keep |= set(range(lines.index(after), len(lines)))
        shown: list[str] = []
        for i in sorted(keep):
            if shown and i - 1 not in keep:
                shown.append(ELLIPSIS)
            shown.append(lines[i])
        return shown

    return pick


# The progress bar's last state. (Lightning's "`Trainer.fit` stopped" line lands on a bar's line in a terminal.)
FINAL_BAR = r"^Epoch \d+: 100%.*val/loss"
SUMMARY = (r"^last validation:", r"^last checkpoint:")
SHOWN: dict[str, Callable[[list[str]], list[str]]] = {
    "quickstart": picker(r"^last validation:", r"^best ", r"^last checkpoint:", after="sample:"),
    "generate": picker(r"."),
    "step1": picker(r"^Seed set", r"^GPU available", *SUMMARY, last=(FINAL_BAR,)),
    "step2": picker(
        r"Seed set", r"^GPU available", r"^distributed_backend", r"Starting with", *SUMMARY, last=(FINAL_BAR,)
    ),
    "step3": picker(
        r"^distributed_backend",
        r"closing signal",
        r"failed \(exitcode",
        r"^Resuming from",
        r"^Restore check passed",
        r"^Resumed from",
        *SUMMARY,
    ),  # fmt: skip
    "step4": picker(
        r"Seed set",
        r"^Initializing distributed",
        r"^-{100}$",
        r"^distributed_backend",
        r"^All distributed",
        *SUMMARY,
        last=(FINAL_BAR,),
    ),
    "step5": picker(r"^distributed_backend", r"\| model +\| GPT", r"Total params", SUMMARY[0], last=(FINAL_BAR,)),
}
# Lines shown but not compared: a text sample, drawn from probabilities that another CPU's float rounding moves.
UNCOMPARED = {"quickstart": "sample:", "generate": ""}


def shown_lines(name: str, text: str) -> list[str]:
    """The lines block ``name`` shows of a run's terminal view ``text``."""
    return SHOWN[name](text.splitlines())


# What changes from run to run however right the run is: a progress bar's times and rates, ports, process ids,
# log time stamps; and in the lines about a resume, the steps (when the kill struck).
VOLATILE = (
    (r"\[\d+:\d+(:\d+)?<[^,\]]*, *[\d.?]+ *(it/s|s/it)", "[TIME]"),
    (r"(127\.0\.0\.1|localhost):\d+", r"\1:PORT"),
    (r"^[IWE]\d{4} [\d:.]+ \d+ ", "LOG "),
    (r"(pid:? |process )\d+", r"\1PID"),
    (r"\b\d{4}-\d\d-\d\dT[\d:+-]+", "DATE"),
)
RESUME_LINE = re.compile(r"Resum|Restor")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def masked(line: str) -> str:
    for pattern, replacement in VOLATILE:
        line = re.sub(pattern, replacement, line)
    if RESUME_LINE.search(line):  # which checkpoint a kill leaves newest depends on when it struck
        line = re.sub(r"checkpoints/\S+\.ckpt", "checkpoints/FILE", line)
        line = re.sub(r"(step[= ]|epoch[= ]|global_step )\d+", r"\1N", line)
    return line


def compared(name: str, shown: list[str]) -> list[str]:
    """The lines of ``shown`` that the test compares (a sample's lines left out), masked (:data:`VOLATILE`)."""
    stop = UNCOMPARED.get(name)
    if stop is not None:
        shown = shown[: shown.index(stop)] if stop in shown else []
    return [masked(line) for line in shown]


def same_line(a: str, b: str, rel_tol: float) -> bool:
    """Whether ``a`` and ``b`` read the same: the same text between their numbers, the same integers, decimals
    within ``rel_tol`` (relative)."""
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        return False
    for x, y in zip(NUMBER.findall(a), NUMBER.findall(b), strict=True):
        if "." in x or "." in y:
            if not math.isclose(float(x), float(y), rel_tol=rel_tol, abs_tol=1e-3 if abs(float(x)) < 0.1 else 0):
                return False
        elif x != y:
            return False
    return True


def differences(name: str, documented: list[str], fresh: list[str], rel_tol: float) -> list[str]:
    """Where block ``name`` as documented reads otherwise than the same lines of a fresh run (empty: none). The shown
    lines are compared in their order; the ``...`` between them are not: which other lines fall between two shown
    ones (another process's line between torchrun's two about a killed worker, in a full suite run) depends on when
    each process wrote."""
    a, b = ([line for line in compared(name, lines) if line != ELLIPSIS] for lines in (documented, fresh))
    if len(a) != len(b):
        return [f"{name}: {len(a)} lines documented, {len(b)} printed:\n" + "\n".join(b)]
    return [
        f"{name}: documented {x!r}, printed {y!r}" for x, y in zip(a, b, strict=True) if not same_line(x, y, rel_tol)
    ]


def regenerate(readme: str, names: Iterable[str] | None = None, log: Callable[[str], None] = print) -> str:
    """``readme`` with the output blocks ``names`` (None: all) replaced by what their commands print now."""
    todo = list(blocks(readme))
    wanted = set(names) if names is not None else {b.name for b in todo}
    if "generate" in wanted:  # it reads the quick start's checkpoint
        wanted.add("quickstart")
    wanted |= {SAME_RUN[n] for n in wanted if n in SAME_RUN}
    texts: dict[str, str] = {}
    commands_by_name = {b.name: b.command for b in todo}
    scratch = scratch_dir()
    for block in todo:
        if block.name not in wanted:
            continue
        source = SAME_RUN.get(block.name)
        if source in texts:
            assert resolve(block.command) == resolve(commands_by_name[source]), f"{block.name}: not {source}'s command"
            texts[block.name] = texts[source]
            continue
        log(f"[{block.name}] {block.command}")
        start_time = time.perf_counter()
        texts[block.name] = run(block.name, block.command, scratch)
        log(f"[{block.name}] {time.perf_counter() - start_time:.0f} s")
    for block in reversed(todo):  # from the end, so that earlier spans stay valid
        if block.name in texts and (names is None or block.name in names):
            new = "\n".join(shown_lines(block.name, texts[block.name])) + "\n"
            readme = readme[: block.span[0]] + new + readme[block.span[1] :]
    return readme


def main(argv: list[str] | None = None) -> int:
    names = (sys.argv[1:] if argv is None else argv) or None
    known = {b.name for b in blocks(README.read_text())}
    if names is not None and not set(names) <= known:
        print(f"unknown blocks {sorted(set(names) - known)}; the README has {sorted(known)}", file=sys.stderr)
        return 2
    README.write_text(regenerate(README.read_text(), names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
