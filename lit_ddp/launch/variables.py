"""The launchers' integer environment variables, checked before Lightning is imported.

Lightning reads the rank from ``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID`` or ``JSM_NAMESPACE_RANK`` with ``int()`` as
it is imported (``lightning.fabric.utilities.rank_zero``), and torch, Lightning's cluster environments and lit-ddp
read the others when processes start: a value that is not a number ends in a ValueError that names no variable.
:func:`check_launch_variables` names it, in one line, before any of them reads it. Standard library only (and
:mod:`lit_ddp.errors`): ``python -m lit_ddp`` runs it before it imports Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lit_ddp.errors import int_from_env

LAUNCH_VARIABLES: dict[str, tuple[str, int]] = {
    "RANK": ("this process's global rank, which torchrun and Lightning's launcher set", 0),
    "LOCAL_RANK": ("this process's rank on its machine, which torchrun and Lightning's launcher set", 0),
    "WORLD_SIZE": ("the number of processes, which torchrun sets", 1),
    "LOCAL_WORLD_SIZE": ("the processes on this machine, torchrun's --nproc_per_node", 1),
    "GROUP_RANK": ("this machine's rank, which torchrun sets", 0),
    "GROUP_WORLD_SIZE": ("the number of machines, torchrun's --nnodes", 1),
    "NODE_RANK": ("this machine's rank, for Lightning's launcher", 0),
    "MASTER_PORT": ("the port of rank zero's rendezvous store", 1),
    "TORCHELASTIC_RESTART_COUNT": ("the restarts torchrun made", 0),
    "SLURM_PROCID": ("the task's global rank, which srun sets", 0),
    "SLURM_LOCALID": ("the task's rank on its node, which srun sets", 0),
    "SLURM_NODEID": ("the node's rank in the job, which srun sets", 0),
    "SLURM_NTASKS": ("the tasks of the job, which Slurm sets", 1),
    "SLURM_RESTART_COUNT": ("the requeues of the job, which Slurm sets", 0),
    "JSM_NAMESPACE_RANK": ("the rank LSF's jsrun gives a task", 0),
    "PL_GLOBAL_SEED": ("the seed Lightning's seed_everything sets", 0),
}
"""Each variable read as an integer: what it holds and who sets it, and its smallest value."""


_checked: dict[str, str | None] | None = None  # the values this process's environment held when last found good


def check_launch_variables(env: Mapping[str, str] | None = None) -> None:
    """Checks that each of :data:`LAUNCH_VARIABLES` that is set holds a whole number (at least its minimum); in this
    process's environment, once while its values stay the same (``python -m lit_ddp`` checks before it imports
    Lightning, the CLI again where it is called from Python).

    Raises:
        UsageError: the first that does not, named with its value.
    """
    global _checked
    values = {name: (os.environ if env is None else env).get(name) for name in LAUNCH_VARIABLES}
    if env is None and values == _checked:
        return
    for name, (meaning, minimum) in LAUNCH_VARIABLES.items():
        int_from_env(name, env, minimum, meaning)
    if env is None:
        _checked = values
