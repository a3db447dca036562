"""Per-step fault tolerance with torchft (an optional extra: ``pip install -e ".[torchft]"``).

Replica groups train the same model; at every step torchft's lighthouse forms a quorum of the groups alive, their
gradients are averaged across the quorum, and a step is committed only where the quorum says so. A group that dies
stops no one else (the others go on at the next step); a restarted group takes the live state of a peer
(:mod:`lit_ddp.ft.heal`) instead of a checkpoint from disk.

- ``strategy.py``: :class:`~lit_ddp.ft.strategy.TorchFTStrategy`, the Lightning strategy of one replica group
  (``configs/trainer/torchft.yaml``);
- ``heal.py``: :class:`~lit_ddp.ft.heal.PeerState`, what a healing group takes from a live peer;
- ``data.py``: each group's share of every global batch, and where a step's batch began (a discarded step's batch
  read again, a healed group's position taken from its peer);
- ``launch.py``: ``python -m lit_ddp.ft.launch``, the lighthouse on loopback and R replica groups on one machine.

torchft is imported by this subpackage and by :mod:`lit_ddp.compat.torchft` (inside its functions, for what of
torchft's private internals the subpackage uses), and by nothing else.
"""
