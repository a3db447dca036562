"""What the restore check (:mod:`lit_ddp.resilience.restore_check`) costs a resume (``make bench-restore``): one rank's
comparison of its restored state with the loaded checkpoint's, against writing that checkpoint (``torch.save`` and
``fsync``); a save pays nothing. The state: the tutorial GPT (8 x 8 x 512, context 128), AdamW after one step, the RNG
states; medians of ``--repeats`` by turns. ``--sharded``: FSDP2 on one process, a DCP checkpoint, which the check
reads a second time into copies of the live shards (:meth:`lit_ddp.strategies.FSDP2Strategy.read_sharded_state`).

    python -m bench.restore_check_cost --model-type gpt-nano --repeats 3   # the plumbing
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bench.harness.launch import gloo_group
from bench.harness.measure import alternate, save_fsynced, seconds
from lit_ddp.resilience.restore import capture_rng
from lit_ddp.resilience.restore_check import first_mismatch, promised, restored
from lit_ddp.tasks.mingpt import GPTModule

VOCAB = "".join(chr(i) for i in range(32, 97))


def stepped(model_type: str, shard: Any = None) -> tuple[GPTModule, Any, torch.optim.Optimizer]:
    """The GPT (``shard``: wrapped by it) and its AdamW after one step."""
    module = GPTModule(model_type=model_type, block_size=128, vocab=VOCAB)
    module.configure_model()
    model = shard(module.model) if shard else module
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, len(VOCAB), (2, 128))
    model(x, x)[1].backward()  # (logits, loss)
    optimizer.step()
    return module, model, optimizer


def report(args: argparse.Namespace, took: dict[str, list[float]], module: GPTModule, what: str) -> dict[str, float]:
    check_s, save_s = statistics.median(took["check"]), statistics.median(took["save"])
    params = sum(p.numel() for p in module.parameters()) / 1e6
    print(f"{args.model_type}{' under FSDP2' if args.sharded else ''}: {params:.1f}M parameters, {what} written in "
          f"{save_s:.3f} s; the restore check: 0 s per save, {check_s:.3f} s per resume ({check_s / save_s:.2f}x a save)")  # fmt: skip
    return {"check_s": check_s, "save_s": save_s}


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="tutorial")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sharded", action="store_true", help="FSDP2 and a sharded checkpoint")
    args = parser.parse_args(argv)
    if args.sharded:
        return sharded(args)
    module, _, optimizer = stepped(args.model_type)
    trainer: Any = SimpleNamespace(global_step=1, optimizers=[optimizer], lr_scheduler_configs=[])
    rng = capture_rng(torch.device("cpu"))
    state = {"global_step": 1, "state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.ckpt"
        save_fsynced(state, path)
        loaded = torch.load(path, weights_only=True)  # what a resume has in memory: other tensors, equal bits

        def check() -> None:
            mismatch = first_mismatch(promised(loaded, rng, True), restored(trainer, module, rng, True))
            assert mismatch is None, mismatch

        took = alternate({"save": lambda: seconds(lambda: save_fsynced(state, path)), "check": lambda: seconds(check)},
                         args.repeats)  # fmt: skip
        return report(args, took, module, f"checkpoint {path.stat().st_size / 1e6:.0f} MB")


def sharded(args: argparse.Namespace) -> dict[str, float]:
    """``--sharded``: one process's FSDP2 model and AdamW, ``dcp.save`` timed against the check's second read and
    comparison, through the strategy's own method on a stand-in for the strategy."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from lit_ddp.resilience.restore_check import _add, _local
    from lit_ddp.strategies import FSDP2Strategy

    with gloo_group():
        module, model, optimizer = stepped(args.model_type, fully_shard)
        strategy: Any = SimpleNamespace(model=model, optimizers=[optimizer])
        strategy.sharded_state = lambda: FSDP2Strategy.sharded_state(strategy)
        with tempfile.TemporaryDirectory() as tmp:

            def check(path: Path) -> None:
                promised_leaves: dict[str, Any] = {}
                restored_leaves: dict[str, Any] = {}
                _add(promised_leaves, "shards", _local(FSDP2Strategy.read_sharded_state(strategy, path)))
                _add(restored_leaves, "shards", _local(strategy.sharded_state()))
                mismatch = first_mismatch(promised_leaves, restored_leaves)
                assert mismatch is None, mismatch

            took: dict[str, list[float]] = {"save": [], "check": []}
            for i in range(args.repeats):  # each check reads the save just before it
                path = Path(tmp) / f"last-{i}.ckpt"
                took["save"].append(seconds(lambda p=path: dcp.save(strategy.sharded_state(), checkpoint_id=p)))
                took["check"].append(seconds(lambda p=path: check(p)))
            size = sum(f.stat().st_size for f in path.iterdir())
    return report(args, took, module, f"sharded checkpoint {size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
