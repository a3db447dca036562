"""Lightning's checkpointing: which checkpoint ``fit(ckpt_path=...)`` resolves to (lit-ddp's agreed choice, in the
private checkpoint connector), ``ModelCheckpoint``'s and ``AsyncCheckpointIO``'s private state, the RNG states a
checkpoint carries, a DDP checkpoint's optimizer state loaded into another parameter order (a Lightning 2.6 bug,
:data:`LIGHTNING_REKEYS_BY_MODEL_ORDER`), and which file systems are object stores."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.fabric.strategies import model_parallel as lightning_model_parallel
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_ddp.compat.imports import lightning_minor, private

LIGHTNING_REKEYS_BY_MODEL_ORDER = lightning_minor(2, 6)
""":func:`rekey_optimizer_states_by_groups`' bug: measured on Lightning 2.6.6; off on another minor until its
test_compat run shows the bug there."""


def install_resume_resolver(trainer: Trainer, marker: str, resolve: Callable[[], str | None]) -> None:
    """Makes ``trainer.fit(ckpt_path=marker)`` resume from ``resolve()``, called once the process group exists.

    Lightning resolves ``ckpt_path`` in its private checkpoint connector (``resume_start``) and offers no
    hook between "the process group exists" and "the checkpoint is read"; its own choices (``"last"``,
    ``"hpc"``) are made per rank, by file name or time.
    """

    connector: Any = private("lightning.pytorch.trainer.connectors.checkpoint_connector", "_CheckpointConnector")

    class _ResolvingConnector(connector):
        def resume_start(self, checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            if checkpoint_path == marker:
                checkpoint_path = resolve()
            super().resume_start(checkpoint_path, weights_only)

    trainer._checkpoint_connector = _ResolvingConnector(trainer)


def hpc_save_path(trainer: Trainer) -> str:
    """``<default_root_dir>/hpc_ckpt_N.ckpt`` with the next free N: the name Lightning's Slurm handler saves to."""
    return str(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def last_saved_step(callback: ModelCheckpoint) -> int:
    """The ``global_step`` of ``callback``'s newest save in this run (0 before any)."""
    return int(callback._last_global_step_saved)


def checkpoint_state_key(callback: ModelCheckpoint, **triggers: Any) -> str:
    """The key ``ModelCheckpoint`` files its state under in a checkpoint, built by Lightning's private
    ``Callback._generate_state_key`` from ``callback``'s monitor, mode and the given ``triggers`` (keyword
    ``every_n_train_steps``, ``every_n_epochs``, ``train_time_interval``), for a subclass whose base is configured
    with other triggers than the ones it was given and whose checkpoints must resume under the same key."""
    return str(callback._generate_state_key(monitor=callback.monitor, mode=callback.mode, **triggers))


def save_last_checkpoint(callback: ModelCheckpoint, trainer: Trainer) -> None:
    """Writes ``callback``'s ``last.ckpt`` now, as its triggers do (ModelCheckpoint has no public call for it).
    Collective: every rank must call it."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def wait_for_async_writes(checkpoint_io: Any) -> None:
    """Blocks until every write of Lightning's ``AsyncCheckpointIO`` in flight is on disk; re-raises a write's
    error. Lightning waits only in ``teardown`` (its executor and error are private)."""
    executor = getattr(checkpoint_io, "_executor", None)
    if executor is None:
        return
    executor.submit(lambda: None).result()  # one worker, FIFO: every earlier write has finished
    if checkpoint_io._error is not None:
        raise checkpoint_io._error


@contextmanager
def rekey_optimizer_states_by_groups(model: Any, optimizers: list[Any]) -> Iterator[None]:
    """While it lasts, ``ModelParallelStrategy`` reads a single-file checkpoint's numbered optimizer states (DDP's)
    in the order of ``optimizers``' groups, as torch numbers them. A bug: Lightning's private
    ``_rekey_optimizer_state_if_needed`` numbers ``model.parameters()`` (``FSDP.rekey_optim_state_dict``,
    pytorch#113673): groups in another order (decay / no-decay, Muon + AdamW) get other parameters' state.
    Measured on Lightning 2.6.6; Lightning's own function stays on another minor
    (:data:`LIGHTNING_REKEYS_BY_MODEL_ORDER`)."""
    if not LIGHTNING_REKEYS_BY_MODEL_ORDER:
        yield
        return
    names = {param: name for name, param in model.named_parameters()}
    pending, original = list(optimizers), lightning_model_parallel._rekey_optimizer_state_if_needed

    def rekey(optimizer_state_dict: dict[str, Any], module: Any) -> dict[str, Any]:
        order = [names[p] for group in pending.pop(0).param_groups for p in group["params"]]
        state, groups = optimizer_state_dict["state"], optimizer_state_dict["param_groups"]
        if not all(isinstance(i, int) for i in state):
            return optimizer_state_dict  # named already (FSDP2's own single-file checkpoints)
        groups = [{**group, "params": [order[i] for i in group["params"]]} for group in groups]
        return {"state": {order[i]: s for i, s in state.items()}, "param_groups": groups}

    lightning_model_parallel._rekey_optimizer_state_if_needed = rekey
    try:
        yield
    finally:
        lightning_model_parallel._rekey_optimizer_state_if_needed = original


def collect_rng_states(include_cuda: bool) -> dict[str, Any]:
    """torch, numpy, Python (and CUDA) RNG states of this process: Lightning's ``_collect_rng_states``."""
    return private("lightning.fabric.utilities.seed", "_collect_rng_states")(include_cuda=include_cuda)


def set_rng_states(states: dict[str, Any]) -> None:
    """Restores what :func:`collect_rng_states` returned: Lightning's ``_set_rng_states``."""
    private("lightning.fabric.utilities.seed", "_set_rng_states")(states)


def is_object_storage(fs: Any) -> bool:
    """Whether an fsspec filesystem is an object store (s3, gs, az...): Lightning's own test."""
    return bool(private("lightning.fabric.utilities.cloud_io", "_is_object_storage")(fs))


def dump_checkpoint(trainer: Trainer) -> dict[str, Any]:
    """The dictionary ``trainer.save_checkpoint`` would write now, without writing it: the module and its
    ``on_save_checkpoint`` extras, optimizers, schedulers, the precision plugin's state (a GradScaler's), the loops, the
    callbacks' states and hooks, the hyperparameters. Lightning builds it in its private checkpoint connector
    (``_CheckpointConnector.dump_checkpoint``) and offers no public call that does not also write the file."""
    return dict(trainer._checkpoint_connector.dump_checkpoint(weights_only=False))


def restore_checkpoint_state(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Puts ``checkpoint`` (:func:`dump_checkpoint`'s layout) into a fit in the middle of training, as Lightning's
    private checkpoint connector restores a file's at the start of one: the module (its ``on_load_checkpoint`` hook
    first), the precision plugin, the callbacks (their ``on_load_checkpoint`` hooks and ``load_state_dict``), then the
    optimizers and LR schedulers. Not the loops: their counts are set by the caller (a heal continues a peer's step,
    which Lightning's loop restore cannot). Lightning restores a checkpoint only from a path, before training."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = checkpoint
    try:
        connector.restore_model()
        connector.restore_precision_plugin_state()
        connector.restore_callbacks()
        connector.restore_optimizers_and_schedulers()
    finally:
        connector._loaded_checkpoint = {}
