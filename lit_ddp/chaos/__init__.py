"""``lit-ddp chaos``, a tool users run on top of the package: a run trained once uninterrupted and once under
faults injected from outside, its two final checkpoints compared bit for bit.

- :mod:`~lit_ddp.chaos.cli`: the command, the fault schedule, the faulted run;
- :mod:`~lit_ddp.chaos.job`: one launch of the run (single process, torchrun, Slurm or torchft's launcher) and its
  processes;
- :mod:`~lit_ddp.chaos.replica_groups`: ``--launcher torchft``: faults in one replica group while the others train
  on, their cost to the survivors, the groups compared with each other;
- :mod:`~lit_ddp.chaos.phase_probe`: the callback added to both runs that tells the step reached;
- :mod:`~lit_ddp.chaos.sketch`: the callback added to both runs that samples the parameters at each logged step;
- :mod:`~lit_ddp.chaos.calibrated`: ``--calibrated K``, the comparison of runs with nondeterministic kernels;
- :mod:`~lit_ddp.chaos.compare`: the two runs' checkpoints and TensorBoard scalars compared.

Only :mod:`lit_ddp.cli` imports it, when ``lit-ddp chaos`` is asked for.
"""
