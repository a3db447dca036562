"""The GPU check in two halves of at most 7 minutes each, every part alone on the GPU, time-boxed, one table per half
(docs/speed.md, "On one GPU"; the Makefile's bench-gpu targets).

    make bench-gpu-speed PYTHON=python3    # main, reference (+ the ratio), tutorial, restart
    make bench-gpu-path PYTHON=python3     # three, chaos_fsdp2, generate, chaos_ddp, determinism
    BENCH_GPU_PARTS="chaos_ddp generate" python3 -m bench.gpu_check    # some parts again
    BENCH_GPU_DRY=1 python -m bench.gpu_check   # every part on the CPU, tiny sizes: the plumbing (a few minutes)

The parts come in order of value, so a run cut short still gives the most. What a part leaves of its box (``BOXES``)
goes to the next; none starts past the boxes' sum. This process is the subreaper of every process the parts start
and ends what one leaves. Output: the table, and under ``$OUT`` (else ``runs/bench_gpu``) ``table.md``,
``results.json``, ``logs.tar.gz``. ``$BENCH_GPU_MAIN_CONFIG``: another main job config than gpu.yaml. Exit status 0
when every part ran and passed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import host_syncs
from bench.harness import launch
from bench.harness.clock import read_clock
from bench.harness.launch import REPO, status_of
from bench.harness.measure import fmt, markdown_table

MARKS = (1.70, 1.55, 1.50, 1.4697)  # val/loss marks; the last is nanoGPT's README figure for this data
NANOGPT_H100 = {"ms_per_iter": 14.5, "seconds_to_mark": 80.0}  # nanoGPT's own train.py on an H100 (issue 44)
RATIO_TARGET = 0.5  # main job / reference, time to 1.4697
RESTART_TARGET = 10.0  # seconds from a kill to the next optimizer step
LINGER_S = 15.0  # a fit must exit within this many seconds of its last optimizer step (the dry run: 60 s, a busy CPU)
BUDGET_S = 420.0  # each half's boxes, setup included, sum to at most this
# Seconds per part on one GPU, from the walls measured on an H200 (2026-11-28, b3d66a4): setup 15-19 (its imports
# from a cold disk), main 65-75, reference 59, tutorial 25, restart 53; (2026-11-27) three 33, the chaos runs past
# 90 s each. The dry run's boxes are for a busy 2-core CPU.
BOXES: dict[str, tuple[float, float]] = {  # part: (GPU box, dry-run box)
    "setup": (30, 90), "main": (115, 150), "reference": (85, 120), "tutorial": (35, 150), "restart": (150, 200),
    "three": (45, 200), "chaos_fsdp2": (130, 250), "generate": (25, 90), "chaos_ddp": (130, 250), "determinism": (25, 120),
}  # fmt: skip
PARTS = tuple(BOXES)
GROUPS = {  # make bench-gpu-speed, make bench-gpu-path
    "speed": ("main", "reference", "tutorial", "restart"),
    "path": ("three", "chaos_fsdp2", "generate", "chaos_ddp", "determinism"),
}
WHEEL_MODULES = ("jsonargparse", "docstring_parser", "typeshed_client", "torchdata")
DDP, FSDP, GPU = "configs/trainer/ddp.yaml", "configs/trainer/fsdp.yaml", "configs/trainer/gpu.yaml"
TUTORIAL, FAULT_TOLERANT = "configs/mingpt/tutorial.yaml", "configs/checkpoint/fault_tolerant.yaml"
EXACT = "configs/checkpoint/exact.yaml"  # deterministic kernels: chaos compares bit for bit
# The dry run's fit arguments: a tiny model on the CPU (num_workers 0: loader processes cost seconds there)
DRY_CPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.devices", "1",
           "--data.init_args.batch_size", "8"]  # fmt: skip
DRY_TUTORIAL = [*DRY_CPU, "--model.init_args.model_type", "gpt-nano", "--data.init_args.num_workers", "0"]
DRY_MAIN = [*DRY_CPU, "--model.init_args.n_layer", "2", "--model.init_args.n_head", "2", "--model.init_args.n_embd",
            "32", "--model.init_args.compile", "false", "--model.init_args.warmup_steps", "5",
            "--data.init_args.block_size", "32"]  # fmt: skip
DRY_MAIN_STEPS = ["--trainer.max_steps", "20", "--trainer.val_check_interval", "10",
                  "--trainer.limit_val_batches", "20", "--trainer.log_every_n_steps", "5"]  # fmt: skip
REFERENCE_LINE = re.compile(r"^step\s+(\d+)\s+([\d.]+) s\s+train/loss ([\d.]+)\s+val/loss ([\d.]+)", re.M)


@dataclass
class Row:
    """One line of the table: ``status`` is ``ok`` or what went wrong; ``figures`` the part's numbers in words;
    ``data`` the same numbers for ``results.json`` and for later parts."""

    part: str
    status: str
    figures: str = ""
    wall: float = 0.0
    box: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    dry: bool
    work: Path
    logs: Path
    env: dict[str, str]
    main_config: str
    linger_s: float = LINGER_S
    rows: dict[str, Row] = field(default_factory=dict)

    def fit(self, name: str, *configs: str, args: list[str]) -> tuple[list[str], Path]:
        """A fresh run directory ``<work>/<name>`` and the fit's command with its step clock ``<work>/<name>.clock``."""
        run, clock = self.work / name, self.work / f"{name}.clock"
        shutil.rmtree(run, ignore_errors=True)
        clock.unlink(missing_ok=True)
        return launch.fit_command(*configs, root=run, clock=clock, args=args), clock

    def fit_figures(self, name: str, *configs: str, args: list[str], box: float) -> tuple[int, dict[str, Any]]:
        """Runs :meth:`fit`'s command: its exit status and figures from its step clock: ``launched``, seconds from
        then to its first step, mean tokens/s and MFU of the logged points after the first, its last step."""
        cmd, clock = self.fit(name, *configs, args=args)
        launched = time.time()
        rc = self.run(name, cmd, box)
        ev = read_clock(clock)
        first, steps = (ev["step"][0][0] - launched, int(ev["step"][-1][1])) if ev["step"] else (None, 0)
        return rc, {"events": ev, "launched": launched, "first_step_s": first, "steps": steps,
                    "tokens_per_s": mean_after_first([e[2] for e in ev["tput"]]),
                    "mfu": mean_after_first([e[3] for e in ev["tput"]])}  # fmt: skip

    def start(self, name: str, cmd: list[str], box: float, env: dict[str, str] | None = None) -> subprocess.Popen:
        return launch.start_boxed(cmd, box, self.logs / f"{name}.log", env or self.env)

    def run(self, name: str, cmd: list[str], box: float) -> int:
        return launch.wait_boxed(self.start(name, cmd, box), box)

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def result(self, name: str, cmd: list[str], box: float, tail: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
        """Runs a benchmark script with ``--json <work>/<name>.json`` (then ``tail``): its exit status and its JSON
        ({} for none)."""
        out = self.work / f"{name}.json"
        out.unlink(missing_ok=True)
        rc = self.run(name, [*cmd, "--json", str(out), *tail], box)
        return rc, json.loads(out.read_text()) if out.is_file() else {}


def seconds_to_marks(points: list[tuple[float, float]], marks: tuple[float, ...] = MARKS) -> dict[float, float | None]:
    """For each mark, the first ``seconds`` of ``points`` (``(seconds, loss)`` in time order) whose loss is at or
    below it; None where none is."""
    return {m: next((s for s, loss in points if loss <= m), None) for m in marks}


def reference_evals(log: str) -> list[tuple[float, float]]:
    """``(seconds after launch, val/loss)`` of every evaluation line :mod:`bench.nanogpt_reference` printed (for a
    run its time box ended before it wrote its JSON)."""
    return [(float(m[2]), float(m[4])) for m in REFERENCE_LINE.finditer(log)]


def mean_after_first(values: list[float]) -> float | None:
    """The mean of the points after the first (the first interval holds the start-up); the only point where there
    is one; None for none."""
    points = [v for v in (values[1:] or values) if not math.isnan(v)]
    return sum(points) / len(points) if points else None


def marks_text(marks: dict[float, float | None]) -> str:
    return f"val/loss {' / '.join(f'{m:g}' for m in marks)} at {' / '.join(fmt(s) for s in marks.values())} s"


def marks_status(rc: int, marks: dict[float, float | None]) -> str:
    status = status_of(rc)
    return f"ok, {MARKS[-1]} not reached" if status == "ok" and marks[MARKS[-1]] is None else status


def table(rows: list[Row], header: str) -> str:
    """The table: one line per part, its wall seconds (and box), status and figures."""
    lines = [[r.part, f"{r.wall:.0f} ({r.box:.0f})" if r.box else "-", r.status, r.figures] for r in rows]
    return f"{header}\n\n{markdown_table(['part', 'wall s (box)', 'status', 'figures'], lines)}\n"


# ---------------------------------------------------------------------------------------------------------------
# The parts: each takes the context and its box (seconds) and returns its row


def part_setup(ctx: Context, box: float) -> Row:
    """The wheels the image lacks, then the imports of a launch once (reading the libraries from disk), so that the
    first timed launch (the main job) does not pay a cold page cache that the reference after it would not."""
    t0 = time.monotonic()
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
        gpu = smi.stdout.strip().replace("\n", "; ") or smi.stderr.strip()
    missing = [m for m in WHEEL_MODULES if importlib.util.find_spec(m) is None]
    notes, site = [gpu], "/tmp/site"
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    if missing and wheels:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", site, *map(str, wheels)]  # fmt: skip
        rc = ctx.run("setup_wheels", pip, box - (time.monotonic() - t0))
        if rc != 0:
            return Row("setup", f"failed (pip rc {rc})", "; ".join(notes), data={"gpu": gpu})
        ctx.env["PYTHONPATH"] = os.pathsep.join([site, ctx.env["PYTHONPATH"]])  # the repository's path follows
        notes.append(f"installed {len(wheels)} wheels into {site} (missing: {', '.join(missing)})")
    elif missing:
        return Row("setup", f"failed: no {', '.join(missing)} and no .whl/", gpu, data={"gpu": gpu})
    warm = [sys.executable, "-c", "import lit_ddp.cli, torch._inductor.compile_fx"]
    rc = ctx.run("setup_imports", warm, box - (time.monotonic() - t0))
    notes.append(f"imports warmed in {time.monotonic() - t0:.0f} s")
    versions = (f"{name} {importlib.metadata.version(name)}" for name in ("torch", "lightning"))  # no import
    notes.append(", ".join([f"Python {sys.version.split()[0]}", *versions]))
    return Row("setup", status_of(rc), "; ".join(notes), data={"gpu": gpu, "missing": missing})


def part_main(ctx: Context, box: float) -> Row:
    """The GPU main job from a fresh run directory: launch to its first step and to each of ``MARKS``, best val/loss,
    tokens/s, MFU, host syncs and kernel launches per step (:mod:`bench.host_syncs`)."""
    syncs = ctx.work / "main.syncs.json"  # host syncs per step, kernel launches: bench/host_syncs.py (issue 52)
    syncs.unlink(missing_ok=True)
    args = [*(DRY_MAIN + DRY_MAIN_STEPS if ctx.dry else []), *host_syncs.callback_args(syncs)]
    rc, f = ctx.fit_figures("main", DDP, ctx.main_config, args=args, box=box)
    launched = f.pop("launched")
    f["host_syncs"] = json.loads(syncs.read_text()) if syncs.is_file() else {}
    marks = seconds_to_marks([(t - launched, loss) for t, _, loss in f["events"]["val"]])
    best = min(f["events"]["val"], key=lambda e: e[2]) if f["events"]["val"] else None
    figures = (
        f"{ctx.main_config}: launch to step 1 {fmt(f['first_step_s'])} s; {marks_text(marks)}; best val/loss "
        f"{fmt(best and best[2], '.4f')} (step {fmt(best and best[1], '.0f')}); {fmt(f['tokens_per_s'], ',.0f')} "
        f"tokens/s; MFU {fmt(f['mfu'], '.3f')}; {f['steps']} steps; {host_syncs.summary_text(f['host_syncs'])}"
    )
    del f["events"]
    return Row("main", marks_status(rc, marks), figures, data={**f, "marks": marks, "best_val_loss": best and best[2]})


def part_reference(ctx: Context, box: float) -> Row:
    """:mod:`bench.nanogpt_reference` ``--recipe gpu`` stopped at 1.4697: the marks, ms/iter, tokens/s, MFU, and on
    an H100 whether it reproduces nanoGPT's figures within 10 %."""
    cmd = [sys.executable, "-m", "bench.nanogpt_reference", "--recipe", "gpu", "--stop_at_target"]
    if ctx.dry:
        cmd += ["--device", "cpu", "--dtype", "float32", "--no-compile", "--n_layer", "2", "--n_head", "2",
                "--n_embd", "32", "--block_size", "32", "--batch_size", "8", "--max_iters", "40",
                "--eval_interval", "10", "--eval_iters", "2", "--threads", "1"]  # fmt: skip
    rc, result = ctx.result("reference", cmd, box)
    evals = [(e["seconds"], e["val_loss"]) for e in result["evals"]] if result else None
    marks = seconds_to_marks(evals or reference_evals(ctx.log("reference")))
    ms, tokens, mfu = result.get("ms_per_iter"), result.get("tokens_per_s"), result.get("mfu")
    eval_iters = result.get("eval_iters", 2 if ctx.dry else 200)
    to_mark = marks[MARKS[-1]]
    gpu = ctx.rows["setup"].data.get("gpu", "") if "setup" in ctx.rows else ""
    within = None
    if ms is not None and to_mark is not None and "H100" in gpu:
        measured = {"ms_per_iter": ms, "seconds_to_mark": to_mark}
        within = all(abs(measured[k] / v - 1) <= 0.10 for k, v in NANOGPT_H100.items())
    verdict = {None: "not compared (no H100 or no figures)", True: "reproduced", False: "NOT reproduced"}[within]
    check = f"nanoGPT's H100 figures (14.5 ms/iter, ~80 s to 1.4697) within 10 %: {verdict}"
    figures = (
        f"nanoGPT GPU recipe: {marks_text(marks)}; {fmt(ms)} ms/iter; {fmt(tokens, ',.0f')} tokens/s; "
        f"MFU {fmt(mfu, '.3f')}; eval {eval_iters} batches per split; {check}"
    )
    data = {"marks": marks, "ms_per_iter": ms, "tokens_per_s": tokens, "mfu": mfu, "eval_iters": eval_iters}
    return Row("reference", marks_status(rc, marks), figures, data=data)


def ratio_row(ctx: Context) -> Row | None:
    """Main job over reference, seconds from launch to 1.4697 (and to the other marks)."""
    main, ref = ctx.rows.get("main"), ctx.rows.get("reference")
    if main is None or ref is None:
        return None
    pairs = [(main.data.get("marks", {}).get(m), ref.data.get("marks", {}).get(m)) for m in MARKS]
    parts = [fmt(a / b if a is not None and b else None, ".2f") for a, b in pairs]
    ratio = parts[-1]
    status = "-" if ratio == "-" else f"{'PASS' if float(ratio) <= RATIO_TARGET else 'FAIL'} (target <= {RATIO_TARGET})"
    figures = f"main / reference, time to val/loss {' / '.join(f'{m:g}' for m in MARKS)}: {' / '.join(parts)}"
    return Row("ratio", status, figures)


def part_tutorial(ctx: Context, box: float) -> Row:
    """The tutorial config on one GPU, a fixed number of steps: its TokenThroughputMonitor's tokens/s and MFU."""
    steps, every = (20, 5) if ctx.dry else (100, 20)
    args = ["--trainer.devices", "1", "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", str(every)]
    rc, f = ctx.fit_figures("tutorial", DDP, TUTORIAL, GPU, args=args + (DRY_TUTORIAL if ctx.dry else []), box=box)
    figures = (
        f"{fmt(f['tokens_per_s'], ',.0f')} tokens/s, MFU {fmt(f['mfu'], '.3f')} (mean of "
        f"{max(len(f['events']['tput']) - 1, 0)} logged points after the first, every {every} steps; target MFU >= "
        f"0.30); launch to step 1 {fmt(f['first_step_s'])} s; {f['steps']} of {steps} steps"
    )
    return Row("tutorial", status_of(rc), figures, data={"tokens_per_s": f["tokens_per_s"], "mfu": f["mfu"]})


def part_restart(ctx: Context, box: float) -> Row:
    """:mod:`bench.recovery` on the main job, one GPU: a SIGKILL to the next optimizer step."""
    cmd = [sys.executable, "-m", "bench.recovery", "--faults", "kill", "--nproc_per_node", "1", "--seed", "1",
           "--configs", DDP, ctx.main_config, "--log", str(ctx.logs / "restart_job.log")]  # fmt: skip
    rc, out = ctx.result("restart", cmd, box, ("--", "--trainer.devices", "1", *(DRY_MAIN if ctx.dry else [])))
    r = out.get("results", {}).get("kill", {})
    figures = (
        f"SIGKILL to the next optimizer step {fmt(r.get('recovery'))} s (target <= {RESTART_TARGET:g}): to the "
        f"restarted worker's start {fmt(r.get('to_restart'))} s, start to step {fmt(r.get('start_to_step'))} s; "
        f"steps repeated {fmt(r.get('repeated'), '.0f')}"
    )
    status = status_of(rc) if rc != 0 or r else "failed (no result)"
    if status == "ok" and r.get("recovery") is not None and r["recovery"] > RESTART_TARGET:
        status = f"ok, over {RESTART_TARGET:g} s"
    return Row("restart", status, figures, data=r)


def part_determinism(ctx: Context, box: float) -> Row:
    """:mod:`bench.deterministic`, the step alone, with and without deterministic kernels."""
    cmd = [sys.executable, "-m", "bench.deterministic"]
    rc, r = ctx.result("determinism", cmd + (["--device", "cpu", "--tiny", "--rounds", "2"] if ctx.dry else []), box)
    figures = (
        f"{r.get('model_type', 'tutorial')} step, {r.get('steps', '-')} steps per mode: default "
        f"{fmt(r.get('tokens_per_s'), ',.0f')} tokens/s, deterministic "
        f"{fmt(r.get('deterministic_tokens_per_s'), ',.0f')} tokens/s: {fmt(r.get('ratio'), '.3f')}x"
    )
    return Row("determinism", status_of(rc) if rc != 0 or r else "failed (no result)", figures, data=r)


def stack_dump(pid: int, log: Path) -> str:
    """A lingering process's stacks into ``log``: ``py-spy dump`` where installed (the process lives on), else
    SIGABRT, which faulthandler (``PYTHONFAULTHANDLER=1``) turns into every thread's traceback on stderr."""
    if shutil.which("py-spy"):
        dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=20)
        with log.open("a") as f:
            f.write("\n==== py-spy dump (bench.gpu_check: lingering) ====\n" + dump.stdout + dump.stderr)
        return "py-spy"
    try:
        os.kill(pid, signal.SIGABRT)
    except ProcessLookupError:
        return "gone"
    return "faulthandler"


def part_three(ctx: Context, box: float) -> Row:
    """Three one-process tutorial fits at once; each must exit within LINGER_S of its last optimizer step."""
    steps, jobs, t0 = 10 if ctx.dry else 30, [], time.monotonic()
    env = {**ctx.env, "PYTHONFAULTHANDLER": "1"}  # SIGABRT: every thread's traceback
    args = ["--trainer.devices", "1", "--trainer.max_steps", str(steps), *(DRY_TUTORIAL if ctx.dry else [])]
    for i in (1, 2, 3):
        cmd, clock = ctx.fit(f"three{i}", DDP, TUTORIAL, GPU, args=args)
        jobs.append({"proc": ctx.start(f"three{i}", cmd, box, env), "clock": clock, "exit": None, "dump": None})
    while any(j["exit"] is None for j in jobs) and time.monotonic() - t0 <= box + launch.KILL_GRACE:
        now = time.time()
        for i, j in enumerate(jobs, 1):
            if j["exit"] is None and j["proc"].poll() is not None:
                j["exit"] = now
            elif j["exit"] is None and j["dump"] is None:
                ev = read_clock(j["clock"])
                done = [e[0] for e in ev["step"] if e[1] >= steps] or [e[0] for e in ev["end"]]
                late = (done and now - done[0] > ctx.linger_s) or time.monotonic() - t0 > box - launch.KILL_GRACE - 3
                if late and ev["start"]:  # its stacks, while it lingers
                    j["dump"] = stack_dump(int(ev["start"][0][1]), ctx.logs / f"three{i}.log")
        time.sleep(0.2)
    exits, lines, ok = [], [], True
    for i, j in enumerate(jobs, 1):
        rc = launch.wait_boxed(j["proc"], 1)
        ev = read_clock(j["clock"])
        last = ev["step"][-1][0] if ev["step"] else None
        after = None if last is None or j["exit"] is None else j["exit"] - last
        exits.append(after)
        good = rc == 0 and after is not None and after <= ctx.linger_s and j["dump"] is None
        ok &= good
        if not good:
            stacks = f", stacks ({j['dump']}) in three{i}.log" if j["dump"] else ""
            lines.append(f"job {i}: rc {rc}, {len(ev['step'])} steps{stacks}")
    figures = (
        f"exit after the last step {' / '.join(fmt(e) for e in exits)} s (limit {ctx.linger_s:g}); {steps} steps each"
    )
    figures += ("; " + "; ".join(lines)) if lines else ""
    return Row("three", "ok" if ok else "FAIL", figures, data={"exit_after_last_step": exits})


def part_chaos(ctx: Context, box: float, strategy: str, kind: str, name: str) -> Row:
    """``lit-ddp chaos`` on the tutorial model under ``strategy``, one ``kind`` fault: its verdict."""
    root = ctx.work / name
    shutil.rmtree(root, ignore_errors=True)
    steps, every = (24, 6) if ctx.dry else (100, 20)
    args = ["--trainer.devices", "1", "--trainer.max_steps", str(steps), "--checkpoint.every_n_train_steps", str(every),
            *(DRY_TUTORIAL if ctx.dry else [])]  # fmt: skip
    fit = launch.fit_command(strategy, TUTORIAL, FAULT_TOLERANT, EXACT, GPU, args=args)
    # lit-ddp chaos takes the fit's arguments after `--`: fit[4:], those after "python -m lit_ddp fit"
    cmd = [sys.executable, "-m", "lit_ddp", "chaos", "--launcher", "single", "--faults", "1", "--kinds", kind, "--seed",
           "1", "--root", str(root), "--timeout", str(int(box)), "--", *fit[4:]]  # fmt: skip
    rc = ctx.run(name, cmd, box)
    log = ctx.log(name).splitlines()
    verdict = next((line for line in log if line.startswith(("identical", "DIFFERENT"))), "")
    cost = next((line for line in log if line.startswith("the faults cost")), "")
    failure = next((line for line in log if line.startswith("lit-ddp chaos:") and "seed" not in line), "")
    figures = f"{strategy.rsplit('/', 1)[-1]}, 1 {kind} fault, {steps} steps, checkpoint every {every}: " + (
        "; ".join(filter(None, [verdict, cost, failure])) or "no verdict"
    )
    status = "identical" if rc == 0 and verdict.startswith("identical") else status_of(rc)
    return Row(name, status if status != "ok" else "ok, no verdict line", figures, data={"verdict": verdict})


def part_generate(ctx: Context, box: float) -> Row:
    """``lit-ddp generate`` on the GPU from the FSDP2 chaos run's checkpoint (another run's where that one is
    missing: the table names it)."""
    names = ["chaos_fsdp2/faulted", "chaos_fsdp2/reference", "chaos_ddp/faulted", "three1", "tutorial"]
    ckpt = next((p for n in names if (p := ctx.work / n / "checkpoints" / "last.ckpt").exists()), None)
    if ckpt is None:
        return Row("generate", "no checkpoint", f"none of {', '.join(names)} under {ctx.work} holds last.ckpt")
    device = "cpu" if ctx.dry else "cuda"
    cmd = [sys.executable, "-m", "lit_ddp", "generate", "--ckpt_path", str(ckpt), "--max_new_tokens", "200"]
    t0 = time.monotonic()
    rc = ctx.run("generate", [*cmd, "--device", device], box)
    seconds = time.monotonic() - t0
    sample = " ".join(line.strip() for line in ctx.log("generate").splitlines()[1:] if line.strip())[:60]
    figures = (
        f"{ckpt.relative_to(ctx.work)}, --device {device}, 200 tokens in {seconds:.1f} s (with the launch): {sample!r}"
    )
    return Row("generate", status_of(rc), figures)


RUNNERS: dict[str, Callable[[Context, float], Row]] = {
    "setup": part_setup, "main": part_main, "reference": part_reference, "tutorial": part_tutorial,
    "restart": part_restart, "determinism": part_determinism, "three": part_three, "generate": part_generate,
    "chaos_fsdp2": lambda ctx, box: part_chaos(ctx, box, FSDP, "term", "chaos_fsdp2"),
    "chaos_ddp": lambda ctx, box: part_chaos(ctx, box, DDP, "kill", "chaos_ddp"),
}  # fmt: skip


def chosen_parts(spec: str | None) -> list[str]:
    """The parts ``spec`` names (space- or comma-separated part or group names), in the table's order, with
    ``setup`` first; every part for None or an empty spec.

    Raises:
        ValueError: a name that is no part and no group.
    """
    names = [n for n in re.split(r"[\s,]+", spec or "") if n]
    if unknown := [n for n in names if n not in PARTS and n not in GROUPS]:
        known = ", ".join((*PARTS, *GROUPS))
        raise ValueError(f"BENCH_GPU_PARTS: unknown part(s) {', '.join(unknown)}; parts and groups: {known}")
    chosen = {p for n in names for p in GROUPS.get(n, (n,))}
    return [p for p in PARTS if not names or p in chosen or p == "setup"]


def main() -> int:
    started = time.monotonic()
    dry = os.environ.get("BENCH_GPU_DRY", "") not in ("", "0")
    try:
        parts = chosen_parts(os.environ.get("BENCH_GPU_PARTS"))
    except ValueError as e:
        print(f"bench.gpu_check: {e}", file=sys.stderr)
        return 2
    budget = sum(BOXES[p][int(dry)] for p in parts)
    out, work = Path(os.environ.get("OUT") or REPO / "runs" / "bench_gpu"), REPO / "runs" / "bench_gpu" / "work"
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    for d in (out, logs):
        d.mkdir(parents=True, exist_ok=True)
    main_config = os.environ.get("BENCH_GPU_MAIN_CONFIG", "configs/mingpt/gpu.yaml")
    env = launch.bench_env(PYTHONUNBUFFERED="1")
    if dry:
        env.setdefault("OMP_NUM_THREADS", "1")  # the dry run's processes share a small CPU: one thread each
    ctx = Context(dry, work, logs, env, main_config, 60 if dry else LINGER_S)
    launch.become_subreaper()
    print(f"bench.gpu_check: {'DRY RUN on the CPU, ' if dry else ''}parts {' '.join(parts)}; budget {budget:.0f} s; "
          f"logs under {logs}", flush=True)  # fmt: skip
    carry = 0.0
    for part in parts:
        nominal = BOXES[part][int(dry)]
        left = budget - (time.monotonic() - started) - 3  # the table's seconds
        box = min(nominal + carry, left)
        if box < 10:
            ctx.rows[part] = Row(part, "skipped: budget spent", box=max(box, 0))
            print(f"== {part}: skipped (budget spent)", flush=True)
            continue
        t0 = time.monotonic()
        try:
            row = RUNNERS[part](ctx, box)
        except Exception as e:  # one part's bug must not cost the table
            row = Row(part, f"error: {type(e).__name__}", str(e)[:300])
        leftovers = launch.end_leftovers(logs / f"{part}_leftovers.log")
        row.wall, row.box = time.monotonic() - t0, box
        if leftovers:
            row.figures += f" ({len(leftovers)} leftover processes killed)"
        ctx.rows[part] = row
        carry = max(0.0, nominal + carry - row.wall)
        print(f"== {part}: {row.wall:.0f} s of {box:.0f}, {row.status}", flush=True)
    rows = [ctx.rows[p] for p in parts if p in ctx.rows]
    if (ratio := ratio_row(ctx)) is not None:
        rows.insert([r.part for r in rows].index("reference") + 1, ratio)
    total = time.monotonic() - started
    gpu = ctx.rows["setup"].data.get("gpu", "?") if "setup" in ctx.rows else "?"
    header = (f"## bench.gpu_check{' (DRY RUN: CPU, tiny sizes)' if dry else ''}: {gpu}; {total:.0f} s of a "
              f"{budget:.0f} s budget; main job config {main_config}")  # fmt: skip
    text = table(rows, header)
    (out / "table.md").write_text(text)
    results = {r.part: asdict(r) for r in rows}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
        for clock in work.glob("*.clock"):
            tar.add(clock, arcname=f"logs/{clock.name}")
        for job in work.glob("chaos_*/*.log"):  # lit-ddp chaos's jobs: reference.log, faulted.log
            tar.add(job, arcname=f"logs/{job.parent.name}_{job.name}")
    print("\n" + text, flush=True)
    good = ("ok", "identical", "PASS")
    return 0 if all(r.status.startswith(good) for r in rows if r.part != "ratio") else 1


if __name__ == "__main__":
    sys.exit(main())
