"""Launch checks: catch the Slurm / torchrun mis-launches that otherwise hang or fail obscurely.

Lightning joins processes that a launcher started (``srun`` -> ``SLURMEnvironment``, ``torchrun`` ->
``TorchElasticEnvironment``) only when the launcher's task layout matches ``trainer.devices`` (processes
per node) and ``trainer.num_nodes``. The mistakes users make most, and what Lightning does with them:

- ``srun -n 2`` without ``--ntasks-per-node``: ``SLURMEnvironment()`` raises inside config instantiation,
  which jsonargparse reports as "does not correspond to a subclass of ...", once per task.
- ``--ntasks-per-node`` != ``trainer.devices`` or ``--nodes`` != ``trainer.num_nodes``: a traceback per task.
- ``srun bash -c "python ..."``: the job is named ``bash``, which Lightning takes for an interactive session;
  Slurm is not detected and every task starts its own independent training into the same directory.
- ``python`` without ``srun`` in a batch script asking for several tasks: Slurm is detected, one process
  starts, and it waits forever for the others.
- a config with the ``SLURMEnvironment`` plugin under ``torchrun``: the plugin overrides torchrun's ranks.

:func:`check_launch` turns each into one :class:`LaunchError` naming the bad value and the right one;
:func:`enforce_launch` prints it once (task 0) and exits with status 2 before anything is instantiated.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

LAUNCH_ERROR_EXIT_CODE = 2
INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # Lightning's ``_is_slurm_interactive_mode``


class LaunchError(ValueError):
    """The processes were launched in a way that does not match the config."""


def _get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _class_paths(plugins: Any) -> list[str]:
    """Class names of ``trainer.plugins`` given as a config (class_path dicts / Namespaces) or objects."""
    if plugins is None:
        return []
    items = plugins if isinstance(plugins, list | tuple) else [plugins]
    names = []
    for item in items:
        class_path = _get(item, "class_path")
        names.append(str(class_path) if class_path is not None else type(item).__name__)
    return names


def _first_int(value: str | None) -> int | None:
    """The leading count of a Slurm task list such as ``2``, ``2(x3)`` or ``2,1``."""
    match = re.match(r"\s*(\d+)", value or "")
    return int(match.group(1)) if match else None


def devices_per_node(devices: Any) -> int | None:
    """``trainer.devices`` as a process count, or ``None`` where only the accelerator can tell (``auto``, -1)."""
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str):
        devices = devices.strip()
        if "," in devices:
            return len([d for d in devices.split(",") if d.strip()])
        if not re.fullmatch(r"\d+", devices):
            return None
        devices = int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    return None


def check_launch(trainer: Any, env: Mapping[str, str] | None = None) -> None:
    """Checks the launch (environment variables of srun / sbatch / torchrun) against the trainer config.

    Args:
        trainer: the ``trainer`` section of the parsed config (a Namespace or a dict): ``devices``,
            ``num_nodes`` and ``plugins`` are read.
        env: the environment to check; defaults to ``os.environ``.

    Raises:
        LaunchError: the first mismatch found, with what would be right.
    """
    env = os.environ if env is None else env
    slurm_plugin = any(p.rsplit(".", 1)[-1] == "SLURMEnvironment" for p in _class_paths(_get(trainer, "plugins")))
    in_job = "SLURM_JOB_ID" in env
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    job_name = env.get("SLURM_JOB_NAME", "")
    interactive = job_name in INTERACTIVE_JOB_NAMES
    ntasks = _first_int(env.get("SLURM_NTASKS"))
    launch_hint = "srun -J NAME --nodes N --ntasks-per-node D python -m lit_ddp fit --config CONFIG"

    if "TORCHELASTIC_RUN_ID" in env:
        if slurm_plugin:
            raise LaunchError(
                "This process was started by torchrun, but the config sets trainer.plugins=SLURMEnvironment, which "
                "would take the ranks from Slurm instead of torchrun. Under torchrun use a config without that "
                "plugin (e.g. configs/regression/torchrun.yaml, or pass --trainer.plugins null); for Slurm's "
                "requeue launch python directly: slurm/train.sbatch."
            )
        return  # TorchElasticEnvironment: torchrun's --nproc_per_node / --nnodes decide

    if slurm_plugin and not in_job:
        raise LaunchError(
            "The config sets trainer.plugins=SLURMEnvironment but this is not a Slurm job (no SLURM_JOB_ID). "
            f"Submit it with `sbatch slurm/train.sbatch CONFIG` or run `{launch_hint}`; without Slurm use a "
            "config without that plugin (e.g. configs/regression/ddp.yaml)."
        )
    if not in_job:
        return

    if in_step and interactive and (ntasks or 1) > 1:
        raise LaunchError(
            f"This job step runs {ntasks} tasks but the job is named {job_name!r}, which Lightning takes for an "
            "interactive session: it would not use Slurm's ranks and every task would start its own training. "
            "Give the job another name (`srun -J train ...`) or launch python directly instead of through a "
            f"shell: `{launch_hint}`."
        )
    if not in_step and not interactive and (ntasks or 1) > 1:
        raise LaunchError(
            f"This is the batch script of a job with SLURM_NTASKS={ntasks}, not an srun step: only this one process "
            f"would start and it would wait forever for the other {ntasks - 1}. Prepend srun: "
            "`srun python -m lit_ddp fit ...` (as slurm/train.sbatch does)."
        )

    # Lightning uses SLURMEnvironment when the config names it or when srun started this process.
    if not slurm_plugin and (interactive or ntasks is None):
        return
    if (ntasks or 1) > 1 and "SLURM_NTASKS_PER_NODE" not in env:
        nodes = _first_int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) or 1
        raise LaunchError(
            f"The job was launched with --ntasks={ntasks} (e.g. `srun -n {ntasks}`) but without --ntasks-per-node, "
            "which Lightning's SLURMEnvironment needs: one task per device on each node. Use "
            f"`--nodes {nodes} --ntasks-per-node={max(1, ntasks // nodes)}` instead of `-n {ntasks}`."
        )
    per_node = _first_int(env.get("SLURM_STEP_TASKS_PER_NODE") if in_step else None) or _first_int(
        env.get("SLURM_NTASKS_PER_NODE")
    )
    devices = _get(trainer, "devices")
    want = devices_per_node(devices)
    if per_node is not None and want is not None and per_node != want:
        raise LaunchError(
            f"Slurm started {per_node} task(s) per node (--ntasks-per-node={per_node}) but trainer.devices={devices}: "
            f"Lightning needs one task per device. Either launch with --ntasks-per-node={want} or pass "
            f"--trainer.devices {per_node}."
        )
    num_nodes = int(_get(trainer, "num_nodes", 1) or 1)
    nnodes = _first_int(env.get("SLURM_STEP_NUM_NODES") if in_step else None) or _first_int(env.get("SLURM_NNODES"))
    if nnodes is not None and nnodes != num_nodes:
        raise LaunchError(
            f"The job runs on {nnodes} node(s) (--nodes={nnodes}) but trainer.num_nodes={num_nodes}. Either "
            f"launch with --nodes={num_nodes} or pass --trainer.num_nodes {nnodes}."
        )


def enforce_launch(trainer: Any, env: Mapping[str, str] | None = None) -> None:
    """:func:`check_launch`, and on a mismatch one message on stderr (from task 0 only) and exit status 2.

    Every task of a bad launch fails the same check, so all of them exit at once: nothing hangs.

    Raises:
        SystemExit: with status ``LAUNCH_ERROR_EXIT_CODE`` on a mismatch.
    """
    env = os.environ if env is None else env
    try:
        check_launch(trainer, env)
    except LaunchError as err:
        if env.get("SLURM_PROCID", env.get("RANK", "0")) in ("0", ""):
            print(f"lit-ddp: launch error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(LAUNCH_ERROR_EXIT_CODE) from None
