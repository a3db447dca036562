"""lit_ddp.launch.environment: the launcher's layout read from its environment (torchrun's process counts)
and the trainer's devices per node."""

from __future__ import annotations

from lit_ddp.launch.environment import devices_per_node, follow_torchrun


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
