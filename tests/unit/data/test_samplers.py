"""lit_ddp.data.samplers: the train sampler's world-size-independent order and its saved position (restored on
another number of processes, another sampler's state refused), and the evaluation sampler's unpadded shards."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lit_ddp.data.samplers import GlobalOrderSampler, evaluation_sampler, this_process

N = 103  # items: 2 and 3 do not divide it


def shards(world_size: int, epoch: int = 0, state: dict | None = None) -> list[list[int]]:
    """What each rank of ``world_size`` draws in ``epoch``, from ``state`` if given."""
    out = []
    for rank in range(world_size):
        sampler = GlobalOrderSampler(range(N), num_replicas=world_size, rank=rank, seed=7)
        sampler.set_epoch(epoch)
        if state is not None:
            sampler.load_state_dict(state)
        out.append(list(sampler))
    return out


def interleave(per_rank: list[list[int]]) -> list[int]:
    """The job's order: step by step, rank by rank (one item per rank and step)."""
    return [i for step in zip(*per_rank, strict=True) for i in step]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_job_draws_one_order_on_any_world_size(world_size: int) -> None:
    one = shards(1)[0]
    assert sorted(one) == list(range(N)) and one != list(range(N))  # a permutation, shuffled
    per_rank = shards(world_size)
    assert all(len(s) == N // world_size for s in per_rank)  # drop_last: the same count on every rank
    assert interleave(per_rank) == one[: N // world_size * world_size]
    assert shards(world_size, epoch=1) != per_rank  # a new permutation each epoch


def test_a_position_saved_on_one_world_size_resumes_on_another(seed: int) -> None:
    """Stopped after a random number of steps on W processes and resumed on W': the job continues with the next
    item of the same order, none lost or repeated (up to the last few that drop_last leaves out)."""
    rng = random.Random(seed)
    saved_world, resumed_world = rng.choice([(1, 2), (2, 3), (3, 1), (2, 1)])
    full = shards(1)[0]
    steps = rng.randrange(1, N // 3)
    samplers = [GlobalOrderSampler(range(N), num_replicas=saved_world, rank=r, seed=7) for r in range(saved_world)]
    drawn = [[next(it) for _ in range(steps)] for it in map(iter, samplers)]
    state = samplers[0].state_dict()
    assert state == {"epoch": 0, "consumed": steps * saved_world, "world_size": saved_world}
    assert interleave(drawn) == full[: steps * saved_world]
    with pytest.warns(UserWarning, match=f"Resuming on {resumed_world} process"):
        rest = interleave(shards(resumed_world, state=state))
    assert rest == full[steps * saved_world :][: len(rest)]
    assert N - steps * saved_world - len(rest) < resumed_world
    assert shards(resumed_world, epoch=1, state=state) == shards(resumed_world, epoch=1)  # another epoch: ignored


def test_another_samplers_state_is_refused() -> None:
    sampler = GlobalOrderSampler(range(N), num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"not a GlobalOrderSampler state \(keys \['yielded'\]\)"):
        sampler.load_state_dict({"yielded": 5})
    with pytest.raises(ValueError, match="consumed=-1 must be >= 0"):
        sampler.load_state_dict({"epoch": 0, "consumed": -1})


def test_without_a_process_group_the_process_is_the_whole_job() -> None:
    assert this_process() == {"num_replicas": 1, "rank": 0}
    assert list(evaluation_sampler(range(N))) == list(range(N))


@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluation_shards_hold_each_item_once(world_size: int) -> None:
    """No item repeated to even out the ranks (a DistributedSampler pads 103 to 104 or 105): the ranks together
    hold each item once, so a sum over them does not depend on the world size."""
    per_rank = []
    for rank in range(world_size):  # the data-parallel ranks of a trainer's device_mesh
        dims = SimpleNamespace(size=lambda: world_size, get_local_rank=lambda r=rank: r)
        trainer = SimpleNamespace(strategy=SimpleNamespace(device_mesh={"data_parallel": dims}))
        per_rank.append(list(evaluation_sampler(range(N), trainer)))
    assert sorted(i for shard in per_rank for i in shard) == list(range(N))
    assert max(map(len, per_rank)) - min(map(len, per_rank)) == 1
