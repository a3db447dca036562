"""What the restore check (:mod:`lit_ddp.resilience.restore_check`) costs a resume, side by side with the save it
guards: the seconds of one rank's comparison of its restored state with the loaded checkpoint's, against the
seconds of writing that checkpoint (``torch.save`` to a local file and ``fsync``, as AtomicCheckpointIO writes it).
A save itself pays nothing: the check reads the checkpoint a resume loads anyway.

The state: the tutorial-size GPT (``configs/mingpt/tutorial.yaml``'s 8 x 8 x 512, context 128) with AdamW's
moments after one step, and the RNG states. Each figure is the median of ``--repeats`` alternated runs.
``--sharded``: the same under FSDP2 on one process (gloo), a sharded checkpoint written by torch's distributed
checkpoint; the check reads it a second time into copies of the live shards and compares them
(:meth:`lit_ddp.strategies.FSDP2Strategy.read_sharded_state`, :func:`lit_ddp.resilience.restore_check.sharded_states`).

    python -m bench.restore_check_cost                 # the tutorial model, about a minute here
    python -m bench.restore_check_cost --sharded       # the same under FSDP2
    python -m bench.restore_check_cost --model-type gpt-nano --repeats 3   # the plumbing
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from lit_ddp.resilience.restore import capture_rng
from lit_ddp.resilience.restore_check import first_mismatch, promised, restored
from lit_ddp.tasks.mingpt import GPTModule


def save(state: dict[str, Any], path: Path) -> None:
    with path.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="tutorial")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sharded", action="store_true", help="FSDP2 and a sharded checkpoint")
    args = parser.parse_args(argv)
    if args.sharded:
        return sharded(args)
    vocab = "".join(chr(i) for i in range(32, 97))
    module = GPTModule(model_type=args.model_type, block_size=128, vocab=vocab)
    module.configure_model()
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    x = torch.randint(0, len(vocab), (2, 128))
    module(x, x)[1].backward()  # (logits, loss)
    optimizer.step()
    trainer: Any = SimpleNamespace(global_step=1, optimizers=[optimizer], lr_scheduler_configs=[])
    rng = capture_rng(torch.device("cpu"))
    state = {"global_step": 1, "state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    took: dict[str, list[float]] = {"check": [], "save": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.ckpt"
        for _ in range(args.repeats):
            t = time.perf_counter()
            save(state, path)
            took["save"].append(time.perf_counter() - t)
        size = path.stat().st_size
        loaded = torch.load(path, weights_only=True)  # what a resume has in memory: other tensors, equal bits
        for _ in range(args.repeats):
            t = time.perf_counter()
            mismatch = first_mismatch(promised(loaded, rng, True), restored(trainer, module, rng, True))
            took["check"].append(time.perf_counter() - t)
            assert mismatch is None, mismatch
    check_s, save_s = statistics.median(took["check"]), statistics.median(took["save"])
    params = sum(p.numel() for p in module.parameters())
    print(
        f"{args.model_type}: {params / 1e6:.1f}M parameters, checkpoint {size / 1e6:.0f} MB written in {save_s:.3f} s; "
        f"the restore check: 0 s per save, {check_s:.3f} s per resume ({check_s / save_s:.2f}x a save)"
    )
    return {"check_s": check_s, "save_s": save_s}


def sharded(args: argparse.Namespace) -> dict[str, float]:
    """``--sharded``: one process's FSDP2 model and AdamW, ``dcp.save`` timed against the check's second read and
    comparison, through the strategy's own method on a stand-in for the strategy."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from lit_ddp.resilience.restore_check import _add, _local
    from lit_ddp.strategies import FSDP2Strategy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        vocab = "".join(chr(i) for i in range(32, 97))
        module = GPTModule(model_type=args.model_type, block_size=128, vocab=vocab)
        module.configure_model()
        model = fully_shard(module.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, len(vocab), (2, 128))
        model(x, x)[1].backward()
        optimizer.step()
        strategy: Any = SimpleNamespace(model=model, optimizers=[optimizer])
        strategy.sharded_state = lambda: FSDP2Strategy.sharded_state(strategy)
        took: dict[str, list[float]] = {"check": [], "save": []}
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.repeats):
                path = Path(tmp) / f"last-{i}.ckpt"
                t = time.perf_counter()
                dcp.save(strategy.sharded_state(), checkpoint_id=path)
                took["save"].append(time.perf_counter() - t)
                t = time.perf_counter()
                promised_leaves: dict[str, Any] = {}
                restored_leaves: dict[str, Any] = {}
                _add(promised_leaves, "shards", _local(FSDP2Strategy.read_sharded_state(strategy, path)))
                _add(restored_leaves, "shards", _local(strategy.sharded_state()))
                mismatch = first_mismatch(promised_leaves, restored_leaves)
                took["check"].append(time.perf_counter() - t)
                assert mismatch is None, mismatch
            size = sum(f.stat().st_size for f in path.iterdir())
    finally:
        dist.destroy_process_group()
    check_s, save_s = statistics.median(took["check"]), statistics.median(took["save"])
    params = sum(p.numel() for p in module.parameters())
    print(
        f"{args.model_type} under FSDP2: {params / 1e6:.1f}M parameters, sharded checkpoint {size / 1e6:.0f} MB "
        f"written in {save_s:.3f} s; the restore check: 0 s per save, {check_s:.3f} s per resume "
        f"({check_s / save_s:.2f}x a save)"
    )
    return {"check_s": check_s, "save_s": save_s}


if __name__ == "__main__":
    main()
