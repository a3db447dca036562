"""Every Lightning/torch internal that lit_ddp.compat uses is still there, and whether each upstream bug it works
around is there on the installed version: each bug's test compares what it measures with the versions compat says
have it (a flag that turns the workaround off elsewhere, or ``LIGHTNING_2_6`` for a workaround that checks the state
it mends), so on any version a failure says which workaround's versions to revisit. ``make test-torch TORCH=X``
runs them on another torch."""

from __future__ import annotations

import ast
import inspect
import os
import re
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from torch.distributed.tensor import Replicate, Shard
from torch.utils.tensorboard import SummaryWriter

from lit_ddp import compat
from lit_ddp.compat.imports import lightning_minor

LIGHTNING_2_6 = lightning_minor(2, 6)
"""The Lightning versions compat's docstrings name for its bugs (2.6.6 measured)."""


def known(bug: str, there: bool, known_there: bool) -> str:
    """The failure message of a bug's test: what the installed version does, against the versions compat names."""
    return (
        f"{bug}: {'there' if there else 'gone'} on torch {compat.TORCH_VERSION}, Lightning {compat.LIGHTNING_VERSION},"
        f" where lit_ddp.compat says it is {'there' if known_there else 'gone'}: revisit that workaround's versions"
        " (docs/development.md's table too)"
    )


@pytest.fixture
def trainer(tmp_path) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)


def test_loop_position_internals(trainer: Trainer) -> None:
    assert compat.should_accumulate(trainer) is False  # no accumulation configured
    assert compat.batches_that_stepped(trainer) == 0
    assert isinstance(compat.should_update_logs(trainer), bool)
    assert compat.validation_due(trainer) is False  # no fit running
    assert "data_fetcher" in inspect.signature(_TrainingEpochLoop._should_check_val_fx).parameters


def test_lightning_still_broadcasts_sigterm_before_every_step(trainer: Trainer) -> None:
    """Lightning issue 21487 / PR 21640: a blocking broadcast per step. When it goes (or becomes an interval),
    compat.disable_sigterm_broadcast can go; it turns nothing off where the broadcast is gone."""
    there = "_broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop)
    assert there == LIGHTNING_2_6, known("the per-step SIGTERM broadcast", there, LIGHTNING_2_6)
    assert compat.disable_sigterm_broadcast(trainer) is there
    if there:
        assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is compat.signals._no_sigterm_broadcast


def test_train_loader_internals(trainer: Trainer) -> None:
    """Per-rank loader states: Lightning saves rank zero's only and restores it on every rank, and rebuilds a
    mid-epoch iterator before setting the sampler's epoch (Lightning issue 20550 for the skipped restore)."""
    assert compat.train_loader_states(trainer) == [] and compat.train_loaders(trainer) == []
    assert compat.restore_train_loaders(trainer, [], 0) is False  # nothing to restore before setup
    fit_loop = trainer.fit_loop
    assert hasattr(fit_loop, "_combined_loader_states_to_load") and hasattr(fit_loop, "_data_fetcher")
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    assert callable(CombinedLoader._state_dicts) and callable(CombinedLoader._load_state_dicts)


def test_rng_state_helpers_roundtrip() -> None:
    states = compat.collect_rng_states(include_cuda=False)
    assert {"torch", "numpy", "python"} <= set(states)
    expected = torch.rand(3)
    compat.set_rng_states(states)
    assert torch.equal(torch.rand(3), expected)


def test_checkpoint_connector_internals(trainer: Trainer) -> None:
    assert compat.hpc_save_path(trainer).endswith("hpc_ckpt_1.ckpt")
    assert list(inspect.signature(_CheckpointConnector.resume_start).parameters) == [
        "self",
        "checkpoint_path",
        "weights_only",
    ]
    seen = []
    compat.install_resume_resolver(trainer, "marker", lambda: seen.append(1) or None)
    trainer._checkpoint_connector.resume_start("marker")
    assert seen == [1]


def test_async_checkpoint_io_has_no_public_wait(tmp_path) -> None:
    """Lightning's AsyncCheckpointIO waits for its writes only in teardown; compat.wait_for_async_writes uses its
    executor. A public wait (or flush) would replace it."""
    assert not any(hasattr(AsyncCheckpointIO, name) for name in ("wait", "flush", "wait_for_writes"))
    from lit_ddp.resilience.checkpoint_io import AsyncAtomicCheckpointIO

    io = AsyncAtomicCheckpointIO()
    io.save_checkpoint({"x": torch.zeros(2)}, tmp_path / "a.ckpt")
    compat.wait_for_async_writes(io)
    assert (tmp_path / "a.ckpt").exists()
    io.teardown()


def test_object_storage_test() -> None:
    import fsspec

    assert compat.is_object_storage(fsspec.filesystem("s3", anon=True)) is True
    assert compat.is_object_storage(fsspec.filesystem("file")) is False


def test_default_store_needs_a_group() -> None:
    with pytest.raises(RuntimeError, match="no default process group"):
        compat.default_store()


def test_summary_writer_has_no_public_event_api(tmp_path) -> None:
    """A purge marker and an HParams summary without values need the FileWriter: SummaryWriter has no public
    method for either."""
    writer = SummaryWriter(str(tmp_path))
    try:
        assert not hasattr(writer, "add_event")
        assert hasattr(compat.tensorboard_file_writer(writer), "add_event")
    finally:
        writer.close()


def test_flatten_hparams() -> None:
    assert compat.flatten_hparams({"a": {"b": 1}}) == {"a/b": 1}


class _EpochCounts(Callback):
    """At each training epoch's start: (current_epoch, the epoch the sampler is set to, _batches_that_stepped)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int]] = []

    def on_train_epoch_start(self, trainer: Trainer, pl_module) -> None:
        self.seen.append(
            (
                trainer.current_epoch,
                trainer.fit_loop.epoch_progress.current.processed,
                compat.batches_that_stepped(trainer),
            )
        )


@pytest.mark.parametrize("undo", [False, True])
@pytest.mark.parametrize("by", ["epochs", "steps"])
def test_lightning_counts_an_epoch_end_twice_on_restart(tmp_path, by: str, undo: bool) -> None:
    """A checkpoint written in on_train_epoch_end (8 batches an epoch, validation at its end), resumed: when
    training is bounded by max_steps, Lightning sets the next epoch's sampler to epoch 2, not 1
    (``compat.undo_epoch_end_recount``, which changes nothing when training is bounded by max_epochs), and counts
    9 batches that stepped, not 8 (``ExactResume`` sets it back at the first batch). When the plain resume by
    steps reads (1, 1, 8), Lightning has fixed both: delete the workarounds."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ddp.data.regression import RegressionDataModule
    from lit_ddp.tasks.regression import RegressionModule

    def fit(epochs: int, *callbacks: Callback, ckpt_path: str | None = None) -> None:
        bounds = {"max_epochs": epochs} if by == "epochs" else {"max_epochs": -1, "max_steps": 8 * epochs}
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **bounds,
                          enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks))  # fmt: skip
        trainer.fit(RegressionModule(), RegressionDataModule(num_samples=288, batch_size=32), ckpt_path=ckpt_path)

    fit(1, ModelCheckpoint(dirpath=tmp_path, save_on_train_epoch_end=True, save_top_k=-1))
    [path] = [str(p) for p in tmp_path.glob("epoch=0-step=8.ckpt")]

    class Undo(Callback):
        def on_train_start(self, trainer: Trainer, pl_module) -> None:
            compat.undo_epoch_end_recount(trainer)

    counts = _EpochCounts()
    fit(2, counts, *([Undo()] if undo else []), ckpt_path=path)
    [(epoch, sampler_epoch, stepped)] = counts.seen
    if by == "epochs" or undo:
        assert (epoch, sampler_epoch) == (1, 1)  # undone where Lightning recounts, left alone where it does not
        assert by == "steps" or stepped == 8
    else:
        there = (epoch, sampler_epoch, stepped) == (1, 2, 9)
        flag = compat.LIGHTNING_RECOUNTS_EPOCH_END
        assert there == flag, known("the epoch end counted twice on restart", there, flag)


@pytest.mark.parametrize("mended", [False, True])
def test_lightning_leaves_the_epoch_after_a_last_batch_restart_uncounted(tmp_path, mended: bool) -> None:
    """Saved after the last of 8 batches (``on_train_batch_end``, step 8), resumed: Lightning starts epoch 1 without
    counting it ready or calling ``on_train_epoch_start``, so its step-12 checkpoint reads as no restart, and a run
    resumed from there trains epoch 1 again from its first batch: it ends at step 20, not 16. With
    ``compat.fix_last_batch_restart`` at ``on_train_start`` it ends at 16. When the plain
    chain ends at 16, Lightning has fixed it: delete the workaround."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ddp.data.regression import RegressionDataModule
    from lit_ddp.tasks.regression import RegressionModule

    class Mend(Callback):
        def on_train_start(self, trainer: Trainer, pl_module) -> None:
            compat.fix_last_batch_restart(trainer)

    def fit(epochs: int, *callbacks: Callback, ckpt_path: str | None = None) -> int:
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, max_epochs=epochs,
                          enable_model_summary=False, default_root_dir=tmp_path, callbacks=list(callbacks))  # fmt: skip
        trainer.fit(RegressionModule(), RegressionDataModule(num_samples=288, batch_size=32), ckpt_path=ckpt_path)
        return trainer.global_step

    def every(n: int) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=n, save_top_k=-1)

    assert fit(1, every(8)) == 8
    counts = _EpochCounts()
    assert (
        fit(2, every(4), counts, *([Mend()] if mended else []), ckpt_path=str(tmp_path / "epoch=0-step=8.ckpt")) == 16
    )
    skipped = not counts.seen  # epoch 1's on_train_epoch_start
    end = fit(2, Mend(), ckpt_path=str(tmp_path / "epoch=1-step=12.ckpt"))
    if mended:
        assert not skipped and end == 16
    else:
        there = skipped and end == 20
        bug = "the epoch after a last-batch restart left uncounted"
        assert there == LIGHTNING_2_6, known(bug, there, LIGHTNING_2_6)


@pytest.mark.parametrize("by", ["epochs", "steps"])
@pytest.mark.parametrize("mended", [False, True])
def test_lightning_leaves_a_mid_epoch_resume_without_a_progress_bar_total(tmp_path, mended: bool, by: str) -> None:
    """Resumed after batch 3 of 8: Lightning skips on_train_epoch_start, so TQDMProgressBar's bar has no total and
    its first description (``Training``); ``compat.show_resumed_epoch`` gives it the epoch's total (bounded by
    max_steps=6: 6, where Lightning's own count of steps left, 3, would end the bar at 3/3 before it starts),
    ``Epoch 0`` and a start at the resumed batch. When the plain resume shows a total, Lightning has fixed
    #20603: delete the workaround."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_ddp.data.regression import RegressionDataModule
    from lit_ddp.tasks.regression import RegressionModule

    class Bar(Callback):
        seen: tuple | None = None

        def on_train_batch_start(self, trainer: Trainer, pl_module, batch, batch_idx: int) -> None:
            if mended and self.seen is None:
                compat.show_resumed_epoch(trainer, batch_idx)

        def on_train_batch_end(self, trainer: Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            bar = trainer.progress_bar_callback.train_progress_bar
            self.seen = self.seen or (bar.total, bar.desc, bar.initial, batch_idx)

    def fit(*callbacks: Callback, ckpt_path: str | None = None) -> None:
        bounds = {"max_epochs": 1} if by == "epochs" else {"max_epochs": -1, "max_steps": 6}
        trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_model_summary=False, **bounds,
                          default_root_dir=tmp_path, callbacks=list(callbacks))  # fmt: skip
        trainer.fit(RegressionModule(), RegressionDataModule(num_samples=288, batch_size=32), ckpt_path=ckpt_path)

    fit(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1))
    bar = Bar()
    fit(bar, ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    total = 8 if by == "epochs" else 6
    if mended:
        assert bar.seen == (total, "Epoch 0: ", 3, 3)
    else:
        there = bar.seen == (None, "Training", 0, 3)
        assert there == LIGHTNING_2_6, known("#20603, no total on a resumed epoch's bar", there, LIGHTNING_2_6)


def test_strategy_timeout_internals() -> None:
    """Lightning keeps a strategy's process-group timeout in ``_timeout`` with no setter (StartupTimeout)."""
    from lightning.pytorch.strategies import DDPStrategy

    strategy = DDPStrategy(timeout=timedelta(seconds=7))
    assert compat.strategy_timeout(strategy) == timedelta(seconds=7)
    compat.set_strategy_timeout(strategy, timedelta(minutes=30))
    assert compat.strategy_timeout(strategy) == timedelta(minutes=30)


def test_process_group_timeout_is_set_by_the_public_api_where_torch_has_it(tmp_path) -> None:
    """torch 2.14 made ``torch.distributed.set_timeout`` public and deprecated the private ``_set_pg_timeout`` (a
    FutureWarning); before it, only the private one sets a live group's timeout. compat.set_process_group_timeout
    takes whichever this torch has, without a warning, and a collective after it still runs."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    public = hasattr(dist, "set_timeout")
    assert public == (compat.TORCH_VERSION.release >= (2, 14)), (
        f"torch {compat.TORCH_VERSION}: set_timeout public? {public}"
    )
    if not public:
        assert list(inspect.signature(c10d._set_pg_timeout).parameters) == ["timeout", "group"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compat.set_process_group_timeout(timedelta(seconds=42))
        dist.all_reduce(torch.ones(1))
    finally:
        dist.destroy_process_group()


def test_model_parallel_strategy_sizes_internals() -> None:
    """``ModelParallelStrategy`` keeps its mesh sizes in ``_data_parallel_size`` / ``_tensor_parallel_size``, its
    "auto" data-parallel size is still ``num_nodes`` (why FSDP2Strategy sets them) and it has no setter."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy()
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == ("auto", "auto")
    assert "self._data_parallel_size = self.num_nodes" in inspect.getsource(ModelParallelStrategy.setup_environment)
    compat.set_model_parallel_sizes(strategy, 4, 2)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 2)


def test_dcp_storage_extents_internals(tmp_path) -> None:
    """A Distributed Checkpoint's metadata names, per tensor, the file and byte range that hold it (``_StorageInfo``
    with ``relative_path``, ``offset``, ``length``): the ranges reach exactly to each file's end."""
    import os

    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.ones(3), "b": torch.zeros(5, 2)}, checkpoint_id=str(tmp_path), no_dist=True)
    extents = compat.dcp_storage_extents(dcp.FileSystemReader(str(tmp_path)).read_metadata())
    assert extents and all(os.path.getsize(tmp_path / name) == end for name, end in extents.items()), extents


def test_strided_shard_internals() -> None:
    """DTensor's private ``_StridedShard`` still takes ``(dim, split_factor=)`` and keeps both. (That rank ``r`` of 2
    then holds rows ``r`` of each of q, k and v: ``tests/system/test_fsdp.py::test_tensor_parallel_splits_q_k_v_by_heads_and_computes_the_same``.)
    Whether it is a ``Shard`` differs by version (a subclass on torch 2.9.1, whose ``is_shard()`` is True; neither on
    2.13.0 and 2.15.0): hence ``is_strided_shard``, which asks its class."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placement = compat.strided_shard(0, split_factor=3)
    assert isinstance(placement, _StridedShard) and (placement.dim, placement.split_factor) == (0, 3)
    assert compat.is_strided_shard(placement)
    assert not compat.is_strided_shard(Shard(0)) and not compat.is_strided_shard(Replicate())


def test_dtensor_keeps_strided_rows_through_a_linear_layer(tmp_path) -> None:
    """The torch bug behind gpt_tensor_parallel's refusal (``compat.strided_rows_survive_linear``): torch 2.9.1's
    DTensor labels ``F.linear``'s output and the weight's gradient a plain ``Shard`` where the weight is split by
    strided rows; 2.13.0 and 2.15.0 keep the strided placement. The probe answers as the weight's gradient does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(DTensor.from_local(torch.ones(6, 4), mesh, [compat.strided_shard(0, 3)]))
        bias = torch.nn.Parameter(DTensor.from_local(torch.zeros(6), mesh, [Replicate()]))
        x = DTensor.from_local(torch.ones(2, 4), mesh, [Replicate()])
        torch.nn.functional.linear(x, weight, bias).to_local().sum().backward()  # local heads, as the GPT's attention
        survives = compat.strided_rows_survive_linear(mesh)
        assert survives == compat.is_strided_shard(weight.grad.placements[0])
        known_there = compat.TORCH_VERSION.release[:2] == (2, 9)
        assert survives != known_there, known("DTensor's linear dropping strided rows", not survives, known_there)
    finally:
        dist.destroy_process_group()


def test_a_missing_private_name_fails_its_workaround_with_the_version() -> None:
    """A version that renames a private name fails the workaround that imports it, naming the library's version and
    the name, not the package's import."""
    with pytest.raises(ImportError, match=rf"torch {re.escape(str(compat.TORCH_VERSION))} has no torch\.nn\._gone"):
        compat.imports.private("torch.nn", "_gone")
    lightning = re.escape(str(compat.LIGHTNING_VERSION))
    with pytest.raises(ImportError, match=rf"lightning {lightning} has no lightning\.nowhere\._gone"):
        compat.imports.private("lightning.nowhere", "_gone")


def test_compat_imports_no_private_name_at_its_top() -> None:
    """Module-level imports of compat's modules name only public names of public modules: a private one moves
    inside the function that uses it (``compat.imports.private``), so a rename breaks that function alone."""
    for path in sorted(Path(compat.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("lit_ddp"):
                names = [node.module, *(alias.name for alias in node.names)]
                assert not any(part.startswith("_") and part != "__future__" for n in names for part in n.split(".")), (
                    f"{path.name}:{node.lineno} imports {names}"
                )


def test_lightning_leaves_the_threads_of_model_parallel_ranks_it_started_unset(monkeypatch) -> None:
    """The bug :func:`compat.threads_like_rank_zero` works around: in a process Lightning's launcher started
    (``LOCAL_RANK`` set), ``ModelParallelStrategy`` configures no launcher, and so nothing sets its threads, where
    ``DDPStrategy`` configures one (whose ``launch`` sets them)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    monkeypatch.setenv("LOCAL_RANK", "1")
    launchers = {}
    for strategy_class in (ModelParallelStrategy, DDPStrategy):
        strategy = strategy_class()
        strategy.cluster_environment = LightningEnvironment()  # as the Trainer's connector sets it
        assert strategy.cluster_environment.creates_processes_externally
        strategy._configure_launcher()
        launchers[strategy_class] = strategy.launcher is not None
    assert launchers[DDPStrategy]
    there = not launchers[ModelParallelStrategy]
    assert there == LIGHTNING_2_6, known("no launcher for ModelParallelStrategy's ranks", there, LIGHTNING_2_6)


def test_threads_like_rank_zero(monkeypatch) -> None:
    """CPUs over processes where ``OMP_NUM_THREADS`` is unset (as rank zero gets from Lightning's launcher); the
    variable's value where it is set."""
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        compat.threads_like_rank_zero(2)
        expected = max(1, len(os.sched_getaffinity(0)) // 2)
        assert torch.get_num_threads() == expected and os.environ["OMP_NUM_THREADS"] == str(expected)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(5)
        compat.threads_like_rank_zero(2)
        assert torch.get_num_threads() == 5, "a set OMP_NUM_THREADS is the user's (or torchrun's): left alone"
    finally:
        torch.set_num_threads(before)


def _numbered_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """A model and an AdamW whose groups list the parameters in another order than ``model.parameters()`` (as
    minGPT's decay / no-decay groups do), and its state_dict after a step (parameters numbered in group order)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    first, second = model[0], model[1]
    optimizer = torch.optim.AdamW([{"params": [second.weight, first.weight]}, {"params": [first.bias, second.bias]}])
    model(torch.ones(4, 2)).sum().backward()
    optimizer.step()
    return model, optimizer, optimizer.state_dict()


def test_lightning_names_a_numbered_optimizer_state_in_the_models_order() -> None:
    """The bug :func:`compat.rekey_optimizer_states_by_groups` works around: Lightning's rekey of a
    single-file checkpoint's optimizer state gives index 0 (``1.weight``'s state, (1, 3)) the name ``0.weight``."""
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed

    model, _, state = _numbered_state()
    named = _rekey_optimizer_state_if_needed(state, model)
    # another parameter's moment, and the first group named 0.weight and 0.bias, not 1.weight and 0.weight
    there = named["state"]["0.weight"]["exp_avg"].shape == (1, 3)
    assert there == (set(named["param_groups"][0]["params"]) == {"0.weight", "0.bias"})
    flag = compat.LIGHTNING_REKEYS_BY_MODEL_ORDER
    assert there == flag, known("a numbered optimizer state named in the model's order", there, flag)


def test_rekey_optimizer_states_by_groups() -> None:
    """Inside the context, Lightning's rekey names each index after the optimizer's own parameter of that index;
    a state named already passes unchanged; on leaving, Lightning's own function is back."""
    from lightning.fabric.strategies import model_parallel

    model, optimizer, state = _numbered_state()
    lightning_rekey = model_parallel._rekey_optimizer_state_if_needed
    with compat.rekey_optimizer_states_by_groups(model, [optimizer, optimizer]):
        named = model_parallel._rekey_optimizer_state_if_needed(state, model)
        assert model_parallel._rekey_optimizer_state_if_needed(named, model) is named
    assert model_parallel._rekey_optimizer_state_if_needed is lightning_rekey
    assert {name: s["exp_avg"].shape for name, s in named["state"].items()} == {
        "1.weight": (1, 3), "0.weight": (3, 2), "0.bias": (3,), "1.bias": (1,),
    }  # fmt: skip
    assert [g["params"] for g in named["param_groups"]] == [["1.weight", "0.weight"], ["0.bias", "1.bias"]]
    assert named["param_groups"][0]["lr"] == state["param_groups"][0]["lr"]


def test_torchs_muon_has_no_batched_step() -> None:
    """What :class:`compat.BatchedMuon` stands in for: torch 2.9 to 2.15's Muon takes no ``foreach`` (open pull
    requests pytorch/pytorch#195566, #187131 add one). Where this fails, gpu.yaml's BatchedOptimizerStep keeps torch's
    Muon: check that it orthogonalizes each shape's matrices together (tests/unit/test_muon.py's aten-op count)
    before the versions here and in compat.torch_muon_is_batched change."""
    there = not compat.torch_muon_is_batched()
    assert there, known("torch's Muon without a batched step", there, True)


def test_muon_per_matrix_is_torchs_step() -> None:
    """compat.muon_per_matrix is torch's Muon step over one group, given whatever settings the group holds (a
    learning-rate scheduler's ``initial_lr`` and the group's ``name`` too)."""
    p, q = (torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0))) for _ in range(2))
    reference = torch.optim.Muon([p], lr=0.1)
    group = {**reference.param_groups[0], "name": "muon", "initial_lr": 0.1}
    p.grad = q.grad = torch.ones(4, 3)
    reference.step()
    buf = torch.zeros(4, 3)
    with torch.no_grad():  # as in a step
        compat.muon_per_matrix([q], [q.grad], [buf], group)
    assert torch.equal(p, q) and torch.equal(buf, reference.state[p]["momentum_buffer"])
