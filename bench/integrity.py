"""What verifying costs (``make bench-integrity``), each with and without side by side in one run, by turns, at make
train's model (``configs/mingpt/cpu.yaml``, gpt-nano) and at the tutorial's GPT (``configs/mingpt/tutorial.yaml``'s
8 x 8 x 512, AdamW: a checkpoint of about 300 MB), one process unless said:

- **save**: ``AtomicCheckpointIO``'s save with torch's CRC-32s (its default) against one without
  (``torch.serialization.set_crc32_options(False)``), and ``torch.save`` into memory the same two ways (the CRC-32s'
  share of the work, without the disk); a sharded checkpoint's save (DCP's shards, ``meta.pt``,
  the commit) with its digest record against one without;
- **resume**: what a resume reads before it restores: on rank zero the choice (``choose``: the newest valid
  checkpoint, verified) and the load; on another rank the load; and a whole resume, ``trainer.fit`` from its start
  to the first training batch (model set-up, the choice, the load, the restore and its check), with the bytes'
  verification against none (``lit_ddp.run_dir.integrity``'s checks turned off). The checkpoint is in the page cache
  both ways (a restart on the node that wrote it);
- **digests**: CRC-32 (zlib's, ISA-L's), SHA-256 and BLAKE2b over the same bytes, in GB/s: why CRC-32;
- **replica check**: 2 DDP processes (``configs/trainer/ddp.yaml``), every check timed on every rank with
  ``replica_check.every_n_steps 1``; its cost per step at N = 1 and at the default N, against the step's time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from bench.harness.clock import read_clock
from bench.harness.launch import QUIET, REPO, fit_command, run
from bench.harness.measure import alternate, arguments, markdown_table, seconds, write_json
from lit_ddp.callbacks.text_samples import FitEndSample
from lit_ddp.cli import LitDDPCLI
from lit_ddp.resilience import replica_check
from lit_ddp.resilience.checkpoint_io import AtomicCheckpointIO
from lit_ddp.resilience.resume import choose, list_candidates
from lit_ddp.run_dir import integrity, sharded, untrusted

CONFIGS = (str(REPO / "configs/trainer/ddp.yaml"), str(REPO / "configs/mingpt/cpu.yaml"))
SIZES = {  # make train's model as configured; the tutorial's GPT with its optimizer (AdamW), a short window
    "cpu.yaml": [],
    "tutorial": ["--model.init_args.model_type", "tutorial", "--model.init_args.optimizer", "adamw",
                 "--data.init_args.block_size", "64", "--data.init_args.batch_size", "4"],
}  # fmt: skip
ONE_PROCESS = ["--trainer.devices", "1", "--trainer.strategy", "auto", "--trainer.limit_val_batches", "0", *QUIET]


@contextlib.contextmanager
def unverified() -> Iterator[None]:
    """Within the block, no byte is checked against a digest and no digest record written: lit-ddp as it read and
    wrote checkpoints before (its structure checks stay)."""
    saved = (integrity.verify_archive, integrity.verify_entries, integrity.verify_metadata,
             integrity.write_digest_record)  # fmt: skip
    integrity.verify_archive = lambda *a, **k: True  # type: ignore[assignment]
    integrity.verify_entries = lambda *a, **k: None  # type: ignore[assignment]
    integrity.verify_metadata = lambda *a, **k: True  # type: ignore[assignment]
    integrity.write_digest_record = lambda *a, **k: None  # type: ignore[assignment]
    try:
        yield
    finally:
        (integrity.verify_archive, integrity.verify_entries, integrity.verify_metadata,
         integrity.write_digest_record) = saved  # fmt: skip


@contextlib.contextmanager
def crc32(on: bool) -> Iterator[None]:
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(on)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def with_zlib(fn: Callable[[], float]) -> float:
    """``fn()`` with zlib's CRC-32 in place of ISA-L's."""
    fast, integrity.crc32 = integrity.crc32, zlib.crc32
    try:
        return fn()
    finally:
        integrity.crc32 = fast


def cli(root: Path, size: str, *args: str) -> LitDDPCLI:
    """The CLI of a one-process fit of ``size`` in ``root``, not run, without the text sample drawn at its end."""
    made = LitDDPCLI(args=fit_command(*CONFIGS, root=root, args=[*ONE_PROCESS, *SIZES[size], *args])[4:], run=False)
    made.trainer.callbacks = [c for c in made.trainer.callbacks if not isinstance(c, FitEndSample)]  # type: ignore[attr-defined]
    return made


def make_checkpoint(root: Path, size: str) -> Path:
    """A run of 2 steps in ``root``: its ``last.ckpt`` (the optimizer's states exist)."""
    made = cli(root, size, "--trainer.max_steps", "2", "--checkpoint.every_n_train_steps", "2")
    made.trainer.fit(made.model, datamodule=made.datamodule)
    return root / "checkpoints" / "last.ckpt"


class FirstBatch(Callback):
    """Records when the first training batch starts (the end of a resume)."""

    at: float | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, i: int) -> None:
        if self.at is None:
            self.at = time.perf_counter()
            trainer.should_stop = True


def whole_resume(checkpoint: Path, root: Path, size: str) -> float:
    """Seconds of ``trainer.fit`` from its call to the first training batch, resuming from ``checkpoint`` (hard-linked
    into the new run directory ``root``: the same bytes, in the page cache)."""
    (root / "checkpoints").mkdir(parents=True)
    os.link(checkpoint, root / "checkpoints" / "last.ckpt")
    integrity.forget()
    resumed = cli(root, size, "--trainer.max_steps", "3", "--checkpoint.every_n_train_steps", "0",
                  "--checkpoint.save_last", "false")  # fmt: skip
    first = FirstBatch()
    resumed.trainer.callbacks.append(first)
    start = time.perf_counter()
    resumed.trainer.fit(resumed.model, datamodule=resumed.datamodule)
    assert first.at is not None
    return first.at - start


def sharded_save(state: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """A sharded checkpoint saved as FSDP2Strategy saves one (one process): DCP's shards and ``meta.pt`` into a
    hidden directory, then the commit (with the digest record)."""
    import torch.distributed.checkpoint as dcp

    written = Path(sharded.temporary_directory(path))
    dcp.save(state, checkpoint_id=str(written), no_dist=True)
    torch.save(meta, written / sharded.META)
    sharded.commit(written, path)


def sharded_resume(path: Path, like: dict[str, Any]) -> None:
    """Rank zero's read of a sharded checkpoint on resume: the choice's checks (every shard there in full, every entry
    verified), then DCP's load into tensors shaped like ``like``'s (the entries known verified: not read again for
    it), then ``meta.pt``."""
    integrity.forget()
    assert sharded.shards_complete(path)
    sharded.verify(path)
    untrusted.dcp_load(_empty_like(like), path, no_dist=True)
    untrusted.load(path / sharded.META)


def _empty_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _empty_like(v) for k, v in tree.items()}
    return torch.empty_like(tree) if isinstance(tree, torch.Tensor) else tree


class CheckTimer(Callback):
    """Times every replica check of a DDP fit on every rank (the CLI's :class:`ReplicaCheck`), and writes
    ``<out>/rank<R>.json``: each check's seconds."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.checks: list[float] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        check = next(c for c in trainer.callbacks if isinstance(c, replica_check.ReplicaCheck))  # type: ignore[attr-defined]
        real = check.check

        def timed(*args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            real(*args, **kwargs)
            self.checks.append(time.perf_counter() - t0)

        check.check = timed  # type: ignore[method-assign]

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        Path(self.out).mkdir(parents=True, exist_ok=True)
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.checks))


def replica_cost(root: Path, size: str, steps: int) -> dict[str, float]:
    """A 2-process DDP fit checking every step: the median check (over both ranks, the first two left out) and the
    median step of rank zero's clock, in seconds."""
    args = [*SIZES[size], "--trainer.max_steps", str(steps), "--replica_check.every_n_steps", "1", *QUIET,
            "--trainer.limit_val_batches", "0", "--checkpoint.every_n_train_steps", "0", "--checkpoint.save_last",
            "false", "--trainer.callbacks+=bench.integrity.CheckTimer",
            f"--trainer.callbacks.init_args.out={root / 'checks'}"]  # fmt: skip
    run(fit_command(*CONFIGS, root=root / "run", args=args, clock=root / "clock.txt"))
    checks = [t for f in sorted((root / "checks").glob("rank*.json")) for t in json.loads(f.read_text())[2:]]
    ends = [event[0] for event in read_clock(root / "clock.txt")["step"]]
    step_times = [b - a for a, b in zip(ends, ends[1:], strict=False)][1:]
    return {"check": statistics.median(checks), "step": statistics.median(step_times), "checks": len(checks)}


def median_of(runs: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in runs.items()}


def measure(base: Path, size: str, skip: list[str], pair: Callable[..., None]) -> None:
    """The save and resume pairs of one model size, in the run directory ``base``."""
    path = make_checkpoint(base / "made", size)
    mb = path.stat().st_size / 1e6
    ckpt = untrusted.load(path)
    checkpoint_io = AtomicCheckpointIO()
    root = str(base / "made")

    def save(on: bool) -> float:
        with crc32(on):
            return seconds(lambda: checkpoint_io.save_checkpoint(ckpt, base / "saved.ckpt"))

    def read(rank_zero: bool, verify: bool) -> float:
        integrity.forget()

        def read_it() -> None:
            if rank_zero:
                assert choose(list_candidates(root), root) == str(path)
            checkpoint_io.load_checkpoint(path)

        with contextlib.nullcontext() if verify else unverified():
            return seconds(read_it)

    count = iter(range(10_000))

    def whole(verify: bool) -> float:
        with contextlib.nullcontext() if verify else unverified():
            return whole_resume(path, base / f"resume{next(count)}", size)

    state = {"state_dict": dict(ckpt["state_dict"])}
    state["optimizer_0"] = {str(k): v for k, v in ckpt["optimizer_states"][0]["state"].items()}
    meta = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    directory = base / "sharded.ckpt"

    def sharded_saved(digest: bool) -> float:
        with contextlib.nullcontext() if digest else unverified():
            return seconds(lambda: sharded_save(state, meta, directory))

    def sharded_read(verify: bool) -> float:
        with contextlib.nullcontext() if verify else unverified():
            return seconds(lambda: sharded_resume(directory, state))

    def save_in_memory(on: bool) -> float:
        with crc32(on):
            return seconds(lambda: torch.save(ckpt, io.BytesIO()))

    if "save" not in skip:
        pair("save (torch's CRC-32s)", size, mb, save)
        pair("torch.save into memory (its CRC-32s)", size, mb, save_in_memory)
    if "resume" not in skip:
        pair("resume read, rank 0 (choose + load)", size, mb, lambda v: read(True, v))
        pair("resume read, another rank (load)", size, mb, lambda v: read(False, v))
    if "whole" not in skip:
        pair("whole resume (fit to its 1st batch)", size, mb, whole)
    if "sharded" not in skip:
        pair("sharded save (digest record)", size, mb, sharded_saved)
        sharded_save(state, meta, directory)  # with its digest record, for the reads
        pair("sharded resume read, rank 0", size, mb, sharded_read)


def digest_speeds(megabytes: int = 256) -> list[list[str]]:
    """GB/s of each digest over ``megabytes`` of random bytes, one thread, best of 3: why CRC-32."""
    import hashlib

    data = os.urandom(megabytes << 20)
    digests: dict[str, Callable[[bytes], Any]] = {"CRC-32, zlib": zlib.crc32}
    if integrity.crc32 is not zlib.crc32:
        digests["CRC-32, ISA-L (isal)"] = integrity.crc32
    digests |= {
        "SHA-256 (hashlib)": lambda b: hashlib.sha256(b).digest(),
        "BLAKE2b (hashlib)": lambda b: hashlib.blake2b(b).digest(),
    }
    rows = []
    for name, digest in digests.items():
        best = min(seconds(lambda digest=digest: digest(data)) for _ in range(3))
        rows.append([name, f"{megabytes / 1024 / best:.2f}"])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions of each pair")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["digests", "save", "resume", "whole", "sharded", "replicas"]
    )
    ns = parser.parse_args(argv)
    results: dict[str, Any] = {}
    rows: list[list[str]] = []

    fast = integrity.crc32 is not zlib.crc32  # ISA-L's: zlib's measured beside it

    def pair(what: str, size: str, mb: float, timed: Callable[[bool], float]) -> None:
        """``timed(True)`` (with digests; where ISA-L's CRC-32 is installed, with zlib's too) and ``timed(False)`` by
        turns, ``--rounds`` each after one of each untimed (threads, allocator, caches); one row of medians."""
        variants = {"with": lambda: timed(True), "without": lambda: timed(False)}
        if fast:
            variants["with, zlib"] = lambda: with_zlib(lambda: timed(True))
        for variant in variants.values():
            variant()
        runs = median_of(alternate(variants, ns.rounds))
        results[f"{what} {size}"] = runs

        def vs(key: str) -> str:
            return f"{runs[key]:.4f} ({100 * (runs[key] / runs['without'] - 1):+.1f} %)"

        rows.append([what, size, f"{mb:.1f}", f"{runs['without']:.4f}", vs("with"), *([vs("with, zlib")] * fast)])
        print(f"{what}, {size}: {runs}", file=sys.stderr, flush=True)

    if "digests" not in ns.skip:
        print("digests over 256 MB in memory, one thread, best of 3")
        print(markdown_table(["digest", "GB/s"], digest_speeds()))
    with tempfile.TemporaryDirectory(prefix="integrity_bench_") as tmp:
        for size in ns.sizes:
            measure(Path(tmp) / size, size, ns.skip, pair)
        cores = len(os.sched_getaffinity(0))
        print(f"one process, {cores} cores; {ns.rounds} rounds per pair, by turns; medians in seconds")
        crc = "ISA-L's CRC-32 (zlib's beside it)" if fast else "zlib's CRC-32 (isal not installed)"
        print(f"digests checked with {crc}")
        columns = ["what", "model", "checkpoint MB", "without s", "with s (vs without)"]
        print(markdown_table(columns + ["with zlib's CRC-32 s"] * fast, rows))
        if "replicas" not in ns.skip:
            replica_rows = []
            for size, steps in (("cpu.yaml", 60), ("tutorial", 8)):
                if size not in ns.sizes:
                    continue
                cost = replica_cost(Path(tmp) / f"replicas_{size}", size, steps)
                results[f"replica check {size}"] = cost
                n = replica_check.EVERY_N_STEPS
                replica_rows.append([size, f"{1000 * cost['check']:.2f}", f"{1000 * cost['step']:.1f}",
                                     f"{100 * cost['check'] / cost['step']:.2f} %",
                                     f"{100 * cost['check'] / n / cost['step']:.4f} %"])  # fmt: skip
            print(
                f"replica check, 2 DDP processes, timed at every step; N = {replica_check.EVERY_N_STEPS} is the default"
            )
            print(markdown_table(["model", "check ms", "step ms", "per step at N = 1",
                                  f"per step at N = {replica_check.EVERY_N_STEPS}"], replica_rows))  # fmt: skip
    write_json(ns.json, results)


if __name__ == "__main__":
    main()
