"""What an atomic checkpoint write costs against ``torch.save`` + fsync of the same state (the tutorial GPT and its
AdamW state, about 300 MB): best seconds and peak resident memory above the state (``VmHWM``), each write in a fresh
process, by turns, into ``--dir`` (``runs/bench_save``). Variants: the floor; ``atomic``
(:class:`~lit_ddp.resilience.checkpoint_io.AtomicCheckpointIO`); ``buffered`` (serialized in memory, then written
atomically); ``async`` (:class:`~lit_ddp.resilience.checkpoint_io.AsyncAtomicCheckpointIO` until its writer is done).
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness.launch import REPO, run
from bench.harness.measure import alternate, markdown_table, save_fsynced

VARIANTS = ("torch.save+fsync", "atomic", "buffered", "async")


def tutorial_checkpoint() -> dict[str, Any]:
    """The tutorial model's weights and AdamW state after one step, as Lightning lays out a checkpoint."""
    from lit_ddp.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=65, block_size=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    idx = torch.randint(0, 65, (2, 128))
    _, loss = model(idx, targets=idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "epoch": 0,
        "global_step": 1,
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
    }


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def write_once(variant: str, directory: Path) -> dict[str, float]:
    """One write of the tutorial checkpoint in this process: seconds, bytes above the memory before it,
    checkpoint bytes."""
    from lit_ddp.resilience.checkpoint_io import AsyncAtomicCheckpointIO, AtomicCheckpointIO
    from lit_ddp.run_dir.atomic import write_atomic

    state = tutorial_checkpoint()
    size = _tensor_bytes(state)
    path = directory / f"{variant}.ckpt"
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    start = time.perf_counter()
    if variant == "torch.save+fsync":
        save_fsynced(state, path)
    elif variant == "atomic":
        AtomicCheckpointIO().save_checkpoint(state, path)
    elif variant == "buffered":
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_atomic(str(path), buffer.getbuffer())
    else:
        writer = AsyncAtomicCheckpointIO()
        writer.save_checkpoint(state, path)
        writer.teardown()  # waits for the writer thread
    seconds = time.perf_counter() - start
    extra = _status("VmHWM") - before
    path.unlink()
    return {"seconds": seconds, "extra": extra, "size": size}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=REPO / "runs" / "bench_save")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(write_once(args.child, args.dir)))
        return

    def write(variant: str) -> dict[str, float]:
        out = run([sys.executable, "-m", "bench.atomic_save", "--child", variant, "--dir", str(args.dir)])
        return json.loads(out.strip().splitlines()[-1])

    results = alternate({v: lambda v=v: write(v) for v in VARIANTS}, args.rounds)
    size = results["atomic"][0]["size"]
    floor = min(r["seconds"] for r in results["torch.save+fsync"])
    print(f"tutorial checkpoint: {size / 1e6:.0f} MB of tensors; {args.rounds} rounds into {args.dir}")
    rows = []
    for variant, runs in results.items():
        best, extra = min(r["seconds"] for r in runs), max(r["extra"] for r in runs)
        rows.append([variant, f"{best:.2f}", f"{best / floor:.2f}", f"{size / best / 1e6:.0f}",
                     f"{extra / 1e6:.0f} MB ({extra / size:.0%})"])  # fmt: skip
    print(markdown_table(["variant", "best s", "x floor", "MB/s", "peak memory above state"], rows))


if __name__ == "__main__":
    main()
