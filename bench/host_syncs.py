"""Host-device synchronizations of the GPU main job's training steps, counted on a CPU (docs/speed.md, "Host
syncs"): gpu.yaml's steps should wait on the device only on the steps that log, save or validate.

:class:`HostSyncs` counts what would synchronize on a GPU: device tensors are those marked (:meth:`HostSyncs.mark`:
parameters, buffers, each batch) and what an aten op computes from one; a sync is an op of :data:`SYNC_OPS` (or
boolean-mask indexing) on one, its ``.tolist`` / ``.numpy`` / ``.cpu``, or a blocking copy of host data to the device
(``torch.tensor(data, device=<torch.device>)``, ``.to(device)`` without ``non_blocking``). Not seen: ``.to("cpu")``,
factory functions on the device. :class:`StepSyncs` books them to each training step (on CUDA:
``torch.cuda.set_sync_debug_mode("warn")``'s warnings).

    python -m bench.host_syncs [--where] [FIT ARGUMENTS]   # a tiny gpu.yaml fit on this CPU, each step's counts
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
import tempfile
import traceback
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils._pytree import tree_leaves

from bench.harness.launch import REPO
from bench.harness.measure import markdown_table
from bench.harness.ops import AtenOps
from lit_ddp import compat

# Aten ops that read a device tensor's values on the host, or size their output by them (a CUDA kernel, then a
# copy of the size to the host). `.item()`, `bool(t)`, `float(t)`, `int(t)` and `if t:` all reach
# _local_scalar_dense; `allclose` and `is_nonzero` decompose into it.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "argwhere", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount",
    "repeat_interleave",
})  # fmt: skip
MASK_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message
OURS = ("bench/host_syncs.py", "bench/harness/ops.py")  # the counter's frames, left out of where a sync is
LAUNCHES = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})  # profiler's

# The tiny gpu.yaml fit: gpu.yaml's settings on this CPU, at a size that takes seconds.
TINY_GPU_JOB = [
    "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.precision", "bf16-mixed",
    "--trainer.enable_progress_bar", "true", "--model.init_args.compile", "false",
    "--model.init_args.n_layer", "2", "--model.init_args.n_head", "2", "--model.init_args.n_embd", "32",
    "--data.init_args.block_size", "32", "--data.init_args.batch_size", "8", "--data.init_args.truncate", "0.05",
]  # fmt: skip


class HostSyncs(AtenOps):
    """While active, counts what would synchronize the host with a GPU (the module's docstring) and the aten ops on
    device tensors, under the label :attr:`phase`; ``device``: the one the module trains on."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.syncs: collections.Counter[Any] = collections.Counter()
        self.where: dict[Any, list[str]] = collections.defaultdict(list)
        self._device_tensors: dict[int, weakref.ref] = {}
        self._patched: list[tuple[Any, str, Any]] = []

    def mark(self, *trees: Any) -> None:
        """Marks every tensor in ``trees`` (nested lists, tuples, dicts) as a device tensor."""
        for tensor in tree_leaves(trees):
            if isinstance(tensor, torch.Tensor):
                forget = functools.partial(lambda key, _: self._device_tensors.pop(key, None), id(tensor))
                self._device_tensors[id(tensor)] = weakref.ref(tensor, forget)

    def on_device(self, tensor: Any) -> bool:
        ref = self._device_tensors.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return ref is not None and ref() is tensor

    def count(self, what: str) -> None:
        self.syncs[self.phase] += 1
        self.where[self.phase].append(f"{what} at {_caller()}")

    def counts(self, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        """An op on a device tensor (the host's own, a loader's collate, launch no kernel), a sync or not."""
        on_device = any(self.on_device(t) for t in tree_leaves((args, kwargs)))
        if on_device and (name in SYNC_OPS or (name in MASK_INDEXING and _has_mask(args))):
            self.count(f"aten.{name}")
        return on_device

    def counted(self, out: Any) -> None:
        self.mark(out)

    def __enter__(self) -> HostSyncs:
        for owner, name, wrap in ((torch.Tensor, "tolist", self._reads), (torch.Tensor, "numpy", self._reads),
                                  (torch.Tensor, "cpu", self._reads), (torch.Tensor, "to", self._copies),
                                  (torch, "tensor", self._makes), (torch, "as_tensor", self._makes)):  # fmt: skip
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(owner, name, wrap(name, original))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        while self._patched:
            owner, name, original = self._patched.pop()
            setattr(owner, name, original)

    def _reads(self, name: str, original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.on_device(tensor):
                return original(tensor, *args, **kwargs)
            self.count(f"Tensor.{name}")
            out = original(tensor, *args, **kwargs)
            if out is tensor:  # .cpu() of a CPU tensor: a GPU tensor's would be a copy, on the host
                out = tensor.clone()
                self._device_tensors.pop(id(out), None)
            return out

        return read

    def _copies(self, name: str, original: Any) -> Any:
        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            out = original(tensor, *args, **kwargs)
            if device is not None and torch.device(device) == self.device and not self.on_device(tensor):
                if not non_blocking and not _from_lightnings_batch_transfer():
                    self.count("Tensor.to(device) of a host tensor")
                self.mark(out)
            return out

        return to

    def _makes(self, name: str, original: Any) -> Any:
        def make(data: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(data, *args, **kwargs)
            device = kwargs.get("device")  # a literal "cpu" is the host: the device comes as a torch.device
            if isinstance(device, torch.device) and device == self.device and not self.on_device(data):
                self.count(f"torch.{name}(..., device=)")
                self.mark(out)
            return out

        return make


def _has_mask(args: Any) -> bool:
    """Whether an indexing op's indices hold a boolean mask (its kernel calls nonzero)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in tree_leaves(indices))


def _from_lightnings_batch_transfer() -> bool:
    return sys._getframe(2).f_globals.get("__name__") == "lightning.fabric.utilities.apply_func"


def _caller() -> str:
    """The innermost frame of the code that asked, outside torch and this module: ``path:line function``."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if "/torch/" in path or path.endswith(OURS) or "/lightning_utilities/" in path:
            continue
        short = path.split("site-packages/")[-1].replace(str(REPO) + "/", "")
        return f"{short}:{frame.lineno} {frame.name}"
    return "?"


@dataclass(eq=False)
class Step:
    """One training step's count: ``step`` is the global step after it."""

    step: int
    logs: bool = False
    saves: bool = False
    validates: bool = False
    syncs: int = 0
    ops: int = 0
    where: list[str] = field(default_factory=list)

    @property
    def quiet(self) -> bool:
        """A step that neither logs, saves nor validates: it must not synchronize."""
        return not (self.logs or self.saves or self.validates)


class StepSyncs(Callback):
    """Books the host syncs and aten ops of each training step (on CUDA: sync warnings, no op count) into
    :attr:`steps`, validation's into :attr:`validation`, from ``from_step`` on. A step runs from its
    ``on_train_batch_start`` to the next one's, validation from its start to the next step's. On CUDA it also counts
    the kernel launches (compiled ones too) of ``launch_steps`` steps, the last ones but one, under
    ``torch.profiler``. With ``out``, rank zero writes :meth:`summary` there as JSON at each validation and at the end.
    """

    def __init__(self, from_step: int = 1, out: str | None = None, launch_steps: int = 0) -> None:
        self.from_step, self.out, self.launch_steps = from_step, out, launch_steps
        self.steps: dict[int, Step] = {}
        self.validation: dict[int, int] = {}  # global step -> syncs of the validation after it
        self.launches: dict[str, Any] = {}  # {"steps": [...], "per_step": kernel launches per step}
        self.counter: HostSyncs | None = None
        self._cuda_warnings: Any = None
        self._caught: list[Any] = []
        self._open: Any = None  # the phase being counted: a Step or ("validation", step)
        self._profile: Any = None  # (torch.profiler.profile, its first step)
        self.counted_by = ""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        device = trainer.strategy.root_device
        if device.type == "cuda":
            self._cuda_warnings = warnings.catch_warnings(record=True)
            self._caught = self._cuda_warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            self.counted_by = "torch.cuda.set_sync_debug_mode('warn') on " + torch.cuda.get_device_name(device)
        else:
            self.counter = HostSyncs(device)
            self.counter.__enter__()
            self.counted_by = f"bench.host_syncs.HostSyncs on {device.type}"

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._close()
        self._stop_profile(trainer.global_step + 1)
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.counter = None
        if self._cuda_warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._cuda_warnings.__exit__(None, None, None)
            self._cuda_warnings = None
        if stage == "fit":
            self._write(trainer)

    def _write(self, trainer: Trainer) -> None:
        if self.out is not None and trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.summary(), indent=1))

    def summary(self) -> dict[str, Any]:
        """The counts in numbers: host syncs of each quiet step (neither logs, saves nor validates) and of each
        other step, with the code of each (its first 20 of each kind on a CPU), aten ops on device tensors per quiet
        step (CPU), kernel launches per step (CUDA), what counted them."""
        quiet = self.quiet_steps()
        others = [s for s in self.steps.values() if not s.quiet]
        where = collections.Counter(w for s in self.steps.values() for w in s.where)
        return {
            "counted_by": self.counted_by,
            # Every logging step syncs (the throughput clock, the logged values): one that shows none means the
            # counting stopped (on CUDA: another warnings.catch_warnings took the warnings over).
            "counting_alive": all(s.syncs > 0 for s in others if s.logs),
            "quiet_step_syncs": [s.syncs for s in quiet],
            "quiet_syncs_max": max((s.syncs for s in quiet), default=None),
            "other_step_syncs": {s.step: s.syncs for s in others},
            "validation_syncs": self.validation,
            "quiet_step_ops": statistics.median(s.ops for s in quiet) if quiet else None,
            "launches": self.launches,
            "where": dict(where.most_common(20)),
        }

    def _close(self) -> None:
        """Books what the open phase counted."""
        phase, self._open = self._open, None
        if phase is None:
            return
        if self.counter is not None:
            syncs, ops = self.counter.syncs.pop(phase, 0), self.counter.ops.pop(phase, 0)
            where = self.counter.where.pop(phase, [])
            self.counter.phase = None
        else:
            where = [f"{w.filename}:{w.lineno}" for w in self._caught if SYNC_WARNING in str(w.message)]
            syncs, ops = len(where), 0
            self._caught.clear()
        if isinstance(phase, Step):
            phase.syncs, phase.ops, phase.where = syncs, ops, where
        else:
            self.validation[phase[1]] = self.validation.get(phase[1], 0) + syncs

    def _start(self, phase: Any) -> None:
        self._close()
        self._open = phase
        if self.counter is not None:
            self.counter.phase = phase
        else:
            self._caught.clear()

    def _stop_profile(self, step: int) -> None:
        """Stops counting at the start of ``step``: the launches per step of the steps counted."""
        if self._profile is None:
            return
        (profile, first), self._profile = self._profile, None
        profile.__exit__(None, None, None)
        launches = sum(e.name in LAUNCHES for e in profile.events())
        steps = list(range(first, step))
        self.launches = {"steps": steps, "per_step": launches / max(len(steps), 1)}

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step + 1
        if self._profile is not None and step >= self._profile[1] + self.launch_steps:
            self._stop_profile(step)
        if self._cuda_warnings is not None and self.launch_steps and step == trainer.max_steps - 1 - self.launch_steps:
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._profile = (torch.profiler.profile(activities=activities).__enter__(), step)  # the last steps but one
        if step < self.from_step:
            self._start(None)
            return
        self.steps[step] = Step(step)
        self._start(self.steps[step])
        if self.counter is not None:
            self.counter.mark(batch, list(pl_module.parameters()), list(pl_module.buffers()))

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(self._open, Step):
            self._open.logs = compat.should_update_logs(trainer)
            self._open.validates = compat.validation_due(trainer)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if isinstance(self._open, Step):
            self._open.saves = True

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._start(("validation", trainer.global_step))
            self._write(trainer)  # what a run cut short by its time box had counted

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start(None)

    def quiet_steps(self) -> list[Step]:
        return [s for s in self.steps.values() if s.quiet]


def callback_args(out: Path | None, from_step: int = 3, launch_steps: int = 2) -> list[str]:
    """The ``lit-ddp fit`` argument adding :class:`StepSyncs` (writing its summary to ``out``)."""
    init = {"from_step": from_step, "out": out and str(out), "launch_steps": launch_steps}
    return ["--trainer.callbacks+=" + json.dumps({"class_path": "bench.host_syncs.StepSyncs", "init_args": init})]


def summary_text(summary: dict[str, Any]) -> str:
    """A :meth:`StepSyncs.summary` in a table's words."""
    if not summary:
        return "host syncs: not counted"
    quiet = summary["quiet_step_syncs"]
    text = f"host syncs per quiet step: {summary['quiet_syncs_max']} at most over {len(quiet)} steps"
    others = summary["other_step_syncs"]
    text += f" (steps that log/save/validate: {min(others.values(), default=0)} to {max(others.values(), default=0)})"
    if not summary["counting_alive"]:
        text += " [counting stopped: a logging step showed none]"
    if launches := summary.get("launches"):
        text += f"; kernel launches per step {launches['per_step']:.0f} (steps {launches['steps']})"
    elif summary.get("quiet_step_ops"):
        text += f"; aten ops on device tensors per quiet step {summary['quiet_step_ops']:.0f}"
    return text


def count_fit(args: list[str], root: str) -> StepSyncs:
    """``lit-ddp fit`` of ``args`` (gpu.yaml's) in ``root`` with :class:`StepSyncs` added: its counts."""
    from lit_ddp.cli import cli_main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = cli_main(["fit", *args, *callback_args(None, 1, 0), "--trainer.default_root_dir", root])
    assert cli is not None
    from bench.host_syncs import StepSyncs as Added  # the class the CLI imported (this one may run as __main__)

    return next(c for c in cli.trainer.callbacks if isinstance(c, Added))  # type: ignore[attr-defined]


def gpu_job_args(max_steps: int = 12, log_every_n_steps: int = 5, val_check_interval: int = 10) -> list[str]:
    """The tiny gpu.yaml fit's arguments (:data:`TINY_GPU_JOB`) after the DDP fragment, on this CPU."""
    configs = [a for c in ("configs/trainer/ddp.yaml", "configs/mingpt/gpu.yaml") for a in ("--config", str(REPO / c))]
    steps = {"max_steps": max_steps, "log_every_n_steps": log_every_n_steps, "val_check_interval": val_check_interval}
    return [*configs, *TINY_GPU_JOB, *(a for k, v in steps.items() for a in (f"--trainer.{k}", str(v)))]


def main(argv: list[str] | None = None) -> StepSyncs:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--where", action="store_true", help="name the code of each sync")
    args, fit_args = parser.parse_known_args(argv)  # the rest go to the fit, after gpu_job_args' (--trainer.max_steps)
    with tempfile.TemporaryDirectory() as root:
        counted = count_fit([*gpu_job_args(), *fit_args], root)
    rows = [[s.step, *("yes" if f else "" for f in (s.logs, s.saves, s.validates)), s.syncs, s.ops]
            for s in counted.steps.values()]  # fmt: skip
    print(markdown_table(["step", "logs", "saves", "validates", "host syncs", "aten ops on device tensors"], rows))
    print(f"host syncs per step that neither logs, saves nor validates: {[s.syncs for s in counted.quiet_steps()]}")
    for s in counted.steps.values():
        if s.syncs:
            lightnings = sum("at lightning/" in w for w in s.where)
            print(f"step {s.step}: {s.syncs - lightnings} host syncs of ours, {lightnings} of Lightning's")
            for line, n in collections.Counter(s.where).items() if args.where else ():
                print(f"    {n} x {line}")
    print(f"validation: {counted.validation} host syncs after the steps named")
    return counted


if __name__ == "__main__":
    main()
