"""Per-step fault tolerance with torchft (an optional extra: ``pip install -e ".[torchft]"``).

Replica groups train the same model; at every step torchft's lighthouse forms a quorum of the groups alive, their
gradients are averaged across the quorum, and a step is committed only where the quorum says so. A group that dies
stops no one else (the others go on at the next step); a restarted group takes the live state of a peer
(:mod:`lit_ddp.ft.heal`) instead of a checkpoint from disk.

- ``strategy.py``: :class:`~lit_ddp.ft.strategy.TorchFTStrategy`, the Lightning strategy of one replica group
  (``configs/trainer/torchft.yaml``);
- ``heal.py``: :class:`~lit_ddp.ft.heal.PeerState`, what a healing group takes from a live peer;
- ``transport.py``: how it travels: a copy taken at the step boundary, served and sent only between holders of the
  job's secret, verified before it is loaded;
- ``membership.py``: the proof, after each new quorum, that its members are the job's groups;
- ``data.py``: each group's share of every global batch, and where a step's batch began (a discarded step's batch
  read again, a healed group's position taken from its peer);
- ``progress.py``: each group's committed step, which its launcher watches;
- ``fingerprint.py``: the groups' final checkpoints compared, every tensor;
- ``lighthouse.py``: torchft's lighthouse in a process of its own;
- ``launch.py``: ``python -m lit_ddp.ft.launch``, the lighthouse and R replica groups on one machine or, with
  ``--slurm``, on the nodes of a Slurm allocation (``slurm/train_torchft.sbatch``).

torchft is imported inside functions only, here and in :mod:`lit_ddp.compat.torchft` (its DDP hook and manager
server's bind), so that the package imports without the extra.
"""
