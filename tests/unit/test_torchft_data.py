"""lit_ddp.ft.data in a one-process fit, torchft's manager replaced by a scripted one: a group trains its share of each
global batch, a discarded step's batch is read again at the next step, a healed group goes on from its peer's
position (and trains its share of the peer's batch at the heal step itself)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lit_ddp import compat
from lit_ddp.data.samplers import GlobalOrderSampler

pytest.importorskip("torchft")

from lit_ddp.ft import data  # noqa: E402 (after the skip: lit_ddp.ft needs torchft)
from lit_ddp.ft.strategy import TorchFTStrategy  # noqa: E402

N, B, GROUPS, SEED = 48, 4, 2, 7  # a global batch of 8: six steps an epoch
STEPS_PER_EPOCH = N // (B * GROUPS)


class Indices(LightningModule):
    """Trains on the dataset indices themselves, recording ``(global_step, epoch, indices)`` of every step, and
    whether Lightning took its batch for the epoch's last (``is_last_batch``, which ends the epoch)."""

    workers = 0  # the train loader's worker processes

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.trained: list[tuple[int, int, list[int]]] = []
        self.last: list[bool] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.trained.append((self.trainer.global_step, self.trainer.current_epoch, x.view(-1).long().tolist()))
        assert batch_idx == self.trainer.global_step % STEPS_PER_EPOCH  # the step's own index, healed or not
        self.last.append(self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> StatefulDataLoader:
        dataset = TensorDataset(torch.arange(N, dtype=torch.float32)[:, None])
        sampler = GlobalOrderSampler(dataset, num_replicas=1, rank=0, seed=SEED)  # the strategy makes it a share
        return StatefulDataLoader(dataset, batch_size=B, sampler=sampler, num_workers=self.workers)


class WithAWorker(Indices):
    workers = 1  # the loader's state then holds its worker's: the repositions load it into a new worker


class ScriptedManager:
    """What the strategy asks of torchft's ``Manager``, scripted by the count of quorums: ``should_commit()`` is
    False at the calls in ``discard``; ``on_quorum(call, peer_state)`` runs in each ``start_quorum`` (a heal: the
    peer state loaded, as torchft's manager does before returning)."""

    def __init__(self, peer_state: Any, discard: set[int], on_quorum: Callable[[int, Any], None] | None) -> None:
        self.peer_state, self.discard, self.on_quorum, self.calls = peer_state, discard, on_quorum, 0
        self.committed = 0

    def start_quorum(self) -> None:
        self.calls += 1
        if self.on_quorum is not None:
            self.on_quorum(self.calls, self.peer_state)

    def num_participants(self) -> int:
        return GROUPS

    def errored(self) -> None:
        return None

    def current_step(self) -> int:
        return self.committed

    def should_commit(self) -> bool:
        self.committed += self.calls not in self.discard
        return self.calls not in self.discard

    def shutdown(self, wait: bool = True) -> None:
        pass


def fit(
    monkeypatch: pytest.MonkeyPatch,
    group: int,
    max_steps: int,
    discard: set[int] = frozenset(),  # type: ignore[assignment]
    on_quorum: Callable[[int, Any], None] | None = None,
    module_class: type[Indices] = Indices,
) -> tuple[Trainer, Indices]:
    monkeypatch.setattr(compat, "fault_tolerant_ddp", lambda manager, module: module)  # no all-reduce: one group
    monkeypatch.setattr(
        TorchFTStrategy, "_manager", lambda self, trainer: ScriptedManager(self.peer_state, discard, on_quorum)
    )
    module = module_class()
    trainer = Trainer(
        strategy=TorchFTStrategy(replica_id=f"group_{group}", replica_groups=GROUPS),
        accelerator="cpu",
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return trainer, module


def share(step: int, group: int) -> list[int]:
    """Group ``group``'s share of the global batch of committed step ``step`` (0-based) in an uninterrupted run."""
    epoch, batch = divmod(step, STEPS_PER_EPOCH)
    order = GlobalOrderSampler(range(N), num_replicas=GROUPS, rank=group, seed=SEED).order(epoch)
    return order[batch * B * GROUPS : (batch + 1) * B * GROUPS][group::GROUPS].tolist()


def committed(module: Indices) -> list[tuple[int, int, list[int]]]:
    """The steps that committed: those the next record's global step is one past (the last one: the fit's end)."""
    trained = module.trained
    return [row for row, after in zip(trained, [*trained[1:], None], strict=True) if after is None or after[0] > row[0]]


@pytest.mark.parametrize("group", [0, 1])
def test_a_group_trains_its_share_of_each_global_batch(monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    print(f"\nsampler seed {SEED}")
    trainer, module = fit(monkeypatch, group, max_steps=2 * STEPS_PER_EPOCH + 1)
    assert [indices for _, _, indices in module.trained] == [share(s, group) for s in range(trainer.global_step)]
    assert [epoch for _, epoch, _ in module.trained] == [s // STEPS_PER_EPOCH for s in range(trainer.global_step)]


def test_shares_of_the_groups_are_disjoint_and_cover_the_global_batch() -> None:
    print(f"\nsampler seed {SEED}")
    for step in range(2 * STEPS_PER_EPOCH):
        shares = [share(step, g) for g in range(GROUPS)]
        assert set(shares[0]).isdisjoint(shares[1]) and len(set(shares[0] + shares[1])) == B * GROUPS


@pytest.mark.parametrize("groups", [2, 3])
def test_a_train_loaders_sampler_is_made_its_groups_reader(groups: int) -> None:
    """Group i of R reads what rank i of R would: its share of each global batch; the position it saves moves by the
    whole global batch. An evaluation loader is left as it is; a group name outside the groups is refused."""
    print(f"\nsampler seed {SEED}")
    for index in range(groups):
        loader = Indices().train_dataloader()
        data.share(loader, groups, index)
        expected = GlobalOrderSampler(range(N), num_replicas=groups, rank=index, seed=SEED)
        assert len(loader) == N // groups // B and list(loader.sampler) == list(expected)
        assert loader.sampler.state_dict()["consumed"] == N // groups * groups
    evaluation = StatefulDataLoader(range(N), batch_size=B)
    data.share(evaluation, groups, 1)
    assert len(evaluation) == N // B
    assert data.group_index("group_1", groups) == 1
    with pytest.raises(ValueError, match=f"group_0 ... group_{groups - 1}"):
        data.group_index(f"group_{groups}", groups)


def test_a_train_loader_without_the_global_order_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GlobalOrderSampler each group would read the whole of its own order: refused before any step."""

    class Plain(Indices):
        def train_dataloader(self) -> StatefulDataLoader:
            return StatefulDataLoader(TensorDataset(torch.arange(N, dtype=torch.float32)[:, None]), batch_size=B)

    with pytest.raises(ValueError, match="train loader 0 has no lit_ddp.data.samplers.GlobalOrderSampler"):
        fit(monkeypatch, 0, max_steps=1, module_class=Plain)


@pytest.mark.parametrize("module_class", [Indices, WithAWorker], ids=["no workers", "a worker"])
def test_a_discarded_steps_batch_is_read_again_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch, module_class: type[Indices]
) -> None:
    """Discarded: the third step, the epoch's last batch (twice in a row) and the next epoch's first. Each is read
    again by the next step; the committed steps read what an uninterrupted run reads, epoch by epoch."""
    print(f"\nsampler seed {SEED}")
    # quorum calls: 1, 2 commit steps 0, 1; 3 discards step 2; 4..7 commit 2..5 less the last: 7, 8 discard step 5 ...
    discard = {3, 7, 8, 10}
    trainer, module = fit(monkeypatch, 1, max_steps=2 * STEPS_PER_EPOCH, discard=discard, module_class=module_class)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    assert trainer.strategy.discarded_steps == len(discard)
    assert len(module.trained) == 2 * STEPS_PER_EPOCH + len(discard)
    for call in discard:  # the batch of a discarded step is the next step's, at the same global step
        assert module.trained[call - 1] == module.trained[call]
    rows = committed(module)
    assert [indices for _, _, indices in rows] == [share(s, 1) for s in range(2 * STEPS_PER_EPOCH)]
    assert [(step, epoch) for step, epoch, _ in rows] == [(s, s // STEPS_PER_EPOCH) for s in range(len(rows))]
    assert module.last == [step % STEPS_PER_EPOCH == STEPS_PER_EPOCH - 1 for step, _, _ in module.trained]


def transported(state: dict[str, Any]) -> dict[str, Any]:
    """The state as the healing group receives it: saved and read back weights-only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    ("step", "module_class"),
    [(0, Indices), (3, Indices), (3, WithAWorker), (STEPS_PER_EPOCH - 1, Indices), (STEPS_PER_EPOCH, Indices)]
    + [(STEPS_PER_EPOCH + 2, Indices)],
    ids=["first", "mid-epoch", "mid-epoch, a worker", "last of an epoch", "first of the next", "mid-way through it"],
)
def test_a_healed_group_trains_its_share_of_its_peers_batch(
    monkeypatch: pytest.MonkeyPatch, step: int, module_class: type[Indices]
) -> None:
    """group_0 is the peer: its state is taken in the quorum of its step ``step`` (the first, as torchft's initial
    sync heals, mid-epoch, the epoch's last batch, the next epoch's first, mid-way through it). A fresh group_1 heals from it in its first quorum: that step
    trains group_1's share of the peer's batch, not the batch its own loop fetched, and every later step the share
    of the same global batch as an uninterrupted run's, through the epochs' ends."""
    print(f"\nsampler seed {SEED}")
    taken: dict[str, Any] = {}

    def take(call: int, peer_state: Any) -> None:
        if call == step + 1:
            taken.update(transported(peer_state.state_dict()))

    peer, peer_module = fit(monkeypatch, 0, max_steps=step + 1, on_quorum=take, module_class=module_class)
    assert taken["exact_resume"]["in_step"]["optimizer_steps"] == step

    def heal(call: int, peer_state: Any) -> None:
        if call == 1:
            peer_state.load_state_dict(taken)

    max_steps = 3 * STEPS_PER_EPOCH
    trainer, module = fit(monkeypatch, 1, max_steps=max_steps, on_quorum=heal, module_class=module_class)
    assert trainer.global_step == max_steps
    assert [indices for _, _, indices in module.trained] == [share(s, 1) for s in range(step, max_steps)]
    assert [(s, epoch) for s, epoch, _ in module.trained] == [(s, s // STEPS_PER_EPOCH) for s in range(step, max_steps)]
    assert module.last == [s % STEPS_PER_EPOCH == STEPS_PER_EPOCH - 1 for s in range(step, max_steps)]
    assert trainer.current_epoch == max_steps // STEPS_PER_EPOCH  # the epochs ended where the peer's do


class Participants:
    """A manager whose quorums hold the given numbers of groups, one per ``start_quorum`` (the last repeated)."""

    def __init__(self, counts: list[int]) -> None:
        self.counts, self.calls, self.reported = counts, 0, []

    def start_quorum(self) -> None:
        self.calls += 1

    def num_participants(self) -> int:
        return self.counts[min(self.calls, len(self.counts)) - 1]

    def errored(self) -> None:
        return None

    def report_error(self, e: Exception) -> None:
        self.reported.append(e)


def settle(counts: list[int], timeout_s: float = 60.0) -> tuple[TorchFTStrategy, float]:
    """A group's first step's quorum settled (:meth:`TorchFTStrategy._settle_quorum`) over quorums of ``counts``
    groups; the strategy and the seconds it took."""
    import datetime
    import time

    strategy = TorchFTStrategy(
        replica_id="group_1", replica_groups=GROUPS, quorum_timeout=datetime.timedelta(seconds=timeout_s)
    )
    strategy.groups, strategy.parallel_devices = GROUPS, [torch.device("cpu")]  # one process
    strategy.manager = Participants(counts)
    strategy.manager.start_quorum()  # the step's own quorum, as optimizer_step asks it first
    started = time.monotonic()
    strategy._settle_quorum()
    return strategy, time.monotonic() - started


def test_a_cold_start_waits_for_every_group_a_restart_for_a_live_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the job's first start (``$TORCHFT_COLD_START``) a group's first step asks for the quorum again until every
    group is in it (so that an older checkpoint heals from the newest rather than training alone), and goes on after
    ``quorum_timeout`` with the groups there; a restarted group waits for one live peer, and without one exits
    without training (it would train alone on a stale state). Each waits once, at its first step."""
    from lit_ddp.ft.strategy import COLD_START_ENV, NoLivePeer

    monkeypatch.setenv(COLD_START_ENV, "1")
    strategy, _ = settle([1, 1, GROUPS])
    assert strategy.manager.calls == 3 and not strategy.manager.reported
    strategy.manager = Participants([1])
    strategy._settle_quorum()  # the second step: no more waiting
    assert strategy.manager.calls == 0

    strategy, waited = settle([1], timeout_s=0.6)
    assert 0.6 <= waited < 10 and strategy.manager.calls >= 3  # asked again for the whole timeout, then went on
    assert not strategy.manager.reported  # with the groups there: the step goes on

    monkeypatch.delenv(COLD_START_ENV)
    strategy, _ = settle([1, 1, 2, 1])
    assert strategy.manager.calls == 3  # a restart: one peer is enough
    with pytest.raises(NoLivePeer, match="found no live group to heal from") as alone:
        settle([1], timeout_s=0.6)
    assert "\n" not in str(alone.value) and alone.value.exit_code == 3


class EditsOnLoad(Indices):
    """A module whose ``load_state_dict`` changes a weight after loading (as a buggy hook would)."""

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        out = super().load_state_dict(*args, **kwargs)
        with torch.no_grad():
            self.layer.weight.add_(1.0)
        return out


def test_a_heal_that_puts_back_another_state_than_the_peers_stops_before_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The restore check of a heal: the state put back is compared with the one the peer sent, bit for bit; a
    difference stops the group with one message naming the first entry, before the step trains."""
    from lit_ddp.errors import RestoreMismatchError

    taken: dict[str, Any] = {}

    def take(call: int, peer_state: Any) -> None:
        if call == 3:
            taken.update(transported(peer_state.state_dict()))

    fit(monkeypatch, 0, max_steps=3, on_quorum=take)

    def heal(call: int, peer_state: Any) -> None:
        if call == 1:
            peer_state.load_state_dict(taken)

    with pytest.raises(RestoreMismatchError, match=r"torchft heal: .* first at parameters/layer\.weight") as e:
        fit(monkeypatch, 1, max_steps=5, on_quorum=heal, module_class=EditsOnLoad)
    assert "\n" not in str(e.value)


class Schedules(Indices):
    """Draws from torch's RNG in every step (as dropout would) and steps a per-batch learning-rate schedule;
    records ``(global_step, lr, draw)`` of every step."""  # numpy's and Python's are not put back: see the strategy

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float, float]] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.seen.append((self.trainer.global_step, lr, float(torch.rand(1))))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_discarded_step_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A discarded step's per-batch schedule does not step and its RNG draws are put back: the committed steps see
    the learning rates and random numbers of an uninterrupted run, and the step after a discard draws what the
    discarded one drew."""
    print(f"\nsampler seed {SEED}")
    torch.manual_seed(SEED)
    _, plain = fit(monkeypatch, 1, max_steps=8, module_class=Schedules)
    torch.manual_seed(SEED)
    discard = {2, 5, 6}
    trainer, faulted = fit(monkeypatch, 1, max_steps=8, discard=discard, module_class=Schedules)
    assert trainer.strategy.discarded_steps == len(discard)
    kept = [row for call, row in enumerate(faulted.seen, start=1) if call not in discard]
    assert kept == plain.seen
    for call in discard:
        assert faulted.seen[call - 1] == faulted.seen[call]  # the step again: same step, lr and draw


def test_a_training_step_returning_none_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's skip would keep the group out of the step's all-reduce (the others wait for it until their
    timeout): refused, naming the step."""
    from lit_ddp.errors import UsageError

    class Skips(Indices):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> Any:
            return None if self.trainer.global_step == 2 else super().training_step(batch, batch_idx)

    with pytest.raises(UsageError, match="training_step returned None at step 2") as refused:
        fit(monkeypatch, 0, max_steps=4, module_class=Skips)
    assert "\n" not in str(refused.value)


def test_min_replicas_has_one_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's (``$TORCHFT_MIN_REPLICAS``, its lighthouse's) unless the strategy gives the same; another value,
    or one above the groups (no step could commit), refused in one line."""
    from lit_ddp.errors import UsageError
    from lit_ddp.ft.strategy import MIN_REPLICAS_ENV

    def resolved(given: int | None) -> int:
        strategy = TorchFTStrategy(min_replicas=given, replica_groups=3)
        strategy.groups = 3
        return strategy._min_replicas()

    assert resolved(None) == 1
    monkeypatch.setenv(MIN_REPLICAS_ENV, "2")
    assert resolved(None) == 2 and resolved(2) == 2
    with pytest.raises(UsageError, match="min_replicas 3 is not the launcher's --min_replicas 2"):
        resolved(3)
    monkeypatch.delenv(MIN_REPLICAS_ENV)
    with pytest.raises(UsageError, match="min_replicas 4 must be between 1 and the 3 replica groups"):
        resolved(4)


def test_too_many_discarded_steps_stop_the_group_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchft's ``max_retries`` (the strategy passes it): where its ``should_commit`` gives up, the group stops with
    one line naming the setting, instead of re-reading one batch forever."""
    from lit_ddp.errors import LitDDPError

    def gives_up(self: ScriptedManager) -> bool:
        raise RuntimeError("should_commit failed 11 times consecutively, exceeding max_retries=10")

    monkeypatch.setattr(ScriptedManager, "should_commit", gives_up)
    with pytest.raises(LitDDPError, match="11 steps in a row discarded at step 0 .*max_retries 10") as stopped:
        fit(monkeypatch, 0, max_steps=3)
    assert "\n" not in str(stopped.value)
