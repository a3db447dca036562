"""lit_ddp.launch.environment: the launcher's layout read from its environment (torchrun's process counts)
and the trainer's devices per node."""

from __future__ import annotations

import pytest

from lit_ddp.launch.environment import TorchrunEnvironment, devices_per_node, follow_torchrun


def test_devices_per_node() -> None:
    assert [devices_per_node(d) for d in (2, "2", [0, 1], "0,1,", "auto", -1, None)] == [2, 2, 2, 2, None, None, None]


def test_trainer_layout_follows_torchrun() -> None:
    torchrun_1 = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}
    trainer = {"devices": 2, "num_nodes": 1}
    assert follow_torchrun(trainer, torchrun_1) == (
        "torchrun started 1 process(es) per node on 2 node(s): trainer.devices=2 -> 1, trainer.num_nodes=1 -> 2"
    )
    assert trainer == {"devices": 1, "num_nodes": 2}
    assert follow_torchrun(trainer, torchrun_1) is None  # already matching
    assert follow_torchrun({"devices": 2}, {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}) is None  # no torchrun
    auto = {"devices": "auto", "num_nodes": 1}
    follow_torchrun(auto, {**torchrun_1, "LOCAL_WORLD_SIZE": "2"})
    assert auto == {"devices": 2, "num_nodes": 1}


def test_nodes_with_different_process_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun --nproc_per_node 2 on one node and 1 on the other: each node's devices are its own count, the nodes
    are torchrun's agents (GROUP_WORLD_SIZE), and the environment accepts what Lightning's rejects (2 x 2 != 3)."""
    node0 = {"TORCHELASTIC_RUN_ID": "7", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "3", "GROUP_WORLD_SIZE": "2"}
    node1 = {**node0, "LOCAL_WORLD_SIZE": "1"}
    for env, devices in ((node0, 2), (node1, 1)):
        trainer = {"devices": 1, "num_nodes": 2}
        follow_torchrun(trainer, env)
        assert trainer == {"devices": devices, "num_nodes": 2}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        TorchrunEnvironment().validate_settings(devices, 2)
    with pytest.raises(ValueError, match="trainer.devices=2 and trainer.num_nodes=2, but torchrun started 1 process"):
        TorchrunEnvironment().validate_settings(2, 2)  # node1's environment
