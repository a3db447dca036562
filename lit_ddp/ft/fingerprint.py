"""Whether the replica groups ended with one model: a fingerprint of every tensor of each group's final checkpoint
(:func:`fingerprint`), compared across the groups (:func:`first_difference`) by ``python -m lit_ddp.ft.launch`` and
``slurm/train_torchft.sbatch`` before they exit (``python -m lit_ddp.ft.fingerprint RUN_DIR ...``).

What must agree is what the groups share: ``global_step``, the module's state, the optimizers' and schedulers'
states and torchft's committed steps. The loop's and loaders' positions differ by design (group ``i`` reads share
``i``), and the RNG streams are not in every checkpoint alike: left out. Each entry is one SHA-256 over its leaves
in order, each leaf's path, dtype, shape and bytes (a tensor) or its ``repr`` (plain data).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lit_ddp.run_dir import layout, sharded

SHARED = ("global_step", "state_dict", "optimizer_states", "lr_schedulers", "torchft")


def _feed(digest: Any, path: str, value: Any) -> None:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _feed(digest, f"{path}/{key}", value[key])
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _feed(digest, f"{path}/{i}", item)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        digest.update(f"{path}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        digest.update(f"{path}={value!r};".encode())


def fingerprint(checkpoint: dict[str, Any]) -> dict[str, str]:
    """``{entry: SHA-256}`` of each of :data:`SHARED` in ``checkpoint`` (absent entries left out)."""
    found = {}
    for key in SHARED:
        if key in checkpoint:
            digest = hashlib.sha256()
            _feed(digest, key, checkpoint[key])
            found[key] = digest.hexdigest()
    return found


def final_fingerprint(run_dir: str | Path) -> tuple[int | None, dict[str, str]]:
    """(``global_step``, :func:`fingerprint`) of the run directory's ``last.ckpt`` (read weights-only); (None, {})
    where it has none."""
    path = Path(layout.last_checkpoint(str(run_dir)))
    if not path.exists():
        return None, {}
    checkpoint = sharded.read_whole(path)
    return checkpoint.get("global_step"), fingerprint(checkpoint)


def first_difference(groups: Mapping[str, str | Path]) -> str | None:
    """One line naming the first group (in order) whose final state differs from the first group's, or that has
    none, and what differs; None where every group ends with the same state."""
    names = list(groups)
    finals = {name: final_fingerprint(groups[name]) for name in names}
    first = names[0]
    step0, prints0 = finals[first]
    if step0 is None:
        return f"{first} has no final checkpoint ({layout.last_checkpoint(str(groups[first]))})"
    for name in names[1:]:
        step, prints = finals[name]
        if step is None:
            return f"{name} has no final checkpoint ({layout.last_checkpoint(str(groups[name]))})"
        differ = [key for key in SHARED if prints.get(key) != prints0.get(key)]
        if differ:
            return (
                f"{name}'s final state differs from {first}'s ({', '.join(differ)}; global_step {step} against {step0})"
            )
    return None


def main(argv: list[str] | None = None) -> int:
    """``python -m lit_ddp.ft.fingerprint NAME=RUN_DIR ...``: prints one line and exits 1 where the groups' final
    states differ, else prints that they agree and exits 0."""
    args = sys.argv[1:] if argv is None else argv
    groups = {arg.split("=", 1)[0] if "=" in arg else Path(arg).name: arg.split("=", 1)[-1] for arg in args}
    if not groups:
        print("usage: python -m lit_ddp.ft.fingerprint NAME=RUN_DIR ...", file=sys.stderr)
        return 2
    found = first_difference(groups)
    if found is not None:
        print(f"the replica groups did not end with one model: {found}", flush=True)
        return 1
    step, _ = final_fingerprint(next(iter(groups.values())))
    print(f"the replica groups' final states agree ({', '.join(groups)}, global_step {step})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
