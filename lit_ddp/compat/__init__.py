"""Every use of Lightning's and torch's private internals, one module per thing it patches, re-exported here
(``from lit_ddp import compat; compat.should_accumulate(trainer)``):

- ``loops.py``: Lightning's training loop (the restart position, when a batch steps and validates, the loaders);
- ``checkpoints.py``: Lightning's checkpointing (the checkpoint ``fit`` resolves to, ``ModelCheckpoint``'s state,
  asynchronous writes, optimizer states and RNG states in a checkpoint, object stores);
- ``strategies.py``: Lightning's strategies (timeout, backend, threads, DDP's stream, precision, mesh sizes);
- ``logging.py``: Lightning's logging and TensorBoard's writer;
- ``signals.py``: Lightning's signal handling;
- ``torch.py``: torch's own (torchdata's loader state, the c10d store and timeout, distributed checkpoint metadata,
  DTensor's strided shards);
- ``torchft.py``: torchft's DDP wrapper (its communication hook, which crashes when a peer group dies mid
  all-reduce) and its manager server (bound to the group's address, not every interface);
- ``muon.py``: torch's Muon stepped in batches (:class:`~lit_ddp.compat.muon.BatchedMuon`), where torch has no
  batched step yet;
- ``imports.py``: the installed versions and the one way a private name is imported.

Each function names what it works around (an upstream issue or PR where there is one); a workaround of a bug states
the torch or Lightning versions known to have it and turns itself off where a version has fixed it (by a version
flag, or by checking the state it mends). ``tests/unit/test_compat.py`` (torchft's: ``test_torchft_compat.py``)
checks on any version that each internal is still there and whether each bug still is; ``make test-torch TORCH=X``
runs it on another torch, and docs/development.md tabulates the workarounds and their versions. Private names are
imported inside the function that uses them (:func:`~lit_ddp.compat.imports.private`): a version that renames one
fails that function, naming the version and what is missing, and not every command at import. Nothing else in the
package touches another object's ``_private`` attribute.
"""

from lit_ddp.compat.checkpoints import (
    LIGHTNING_REKEYS_BY_MODEL_ORDER,
    checkpoint_state_key,
    collect_rng_states,
    dump_checkpoint,
    hpc_save_path,
    install_resume_resolver,
    is_object_storage,
    last_saved_step,
    rekey_optimizer_states_by_groups,
    restore_checkpoint_state,
    save_last_checkpoint,
    set_rng_states,
    wait_for_async_writes,
)
from lit_ddp.compat.imports import LIGHTNING_VERSION, TORCH_VERSION
from lit_ddp.compat.logging import (
    default_hp_metric,
    flatten_hparams,
    log_metrics,
    pending_train_step_log,
    should_update_logs,
    tensorboard_file_writer,
    tensorboard_hparams,
)
from lit_ddp.compat.loops import (
    LIGHTNING_RECOUNTS_EPOCH_END,
    batches_that_stepped,
    fix_last_batch_restart,
    loop_progress,
    next_train_batch,
    optimizer_steps,
    reposition_train_loaders,
    restore_loop_position,
    restore_train_loaders,
    set_batches_that_stepped,
    set_loop_progress,
    set_optimizer_steps,
    should_accumulate,
    show_resumed_epoch,
    train_loader_states,
    train_loaders,
    uncount_batch,
    undo_epoch_end_recount,
    validation_due,
)
from lit_ddp.compat.muon import (
    BatchedMuon,
    muon_per_matrix,
    torch_muon_is_batched,
)
from lit_ddp.compat.signals import (
    after_lightning_signal_handlers,
    disable_sigterm_broadcast,
    exit_now,
)
from lit_ddp.compat.strategies import (
    DDPOnTheTrainingStream,
    compute_dtype,
    process_group_backend,
    set_model_parallel_sizes,
    set_strategy_timeout,
    strategy_timeout,
    threads_like_rank_zero,
)
from lit_ddp.compat.torch import (
    dcp_entries,
    dcp_full_state_planner,
    dcp_private_metadata_classes,
    dcp_storage_extents,
    default_store,
    is_strided_shard,
    loader_workers,
    sampler_state,
    set_process_group_timeout,
    strided_rows_survive_linear,
    strided_shard,
    worker_seed,
)
from lit_ddp.compat.torchft import (
    bind_manager_server,
    comm_hook,
    fault_tolerant_ddp,
    manager_binds_every_interface,
    stock_hook_survives_failed_allreduce,
)

__all__ = [
    "dump_checkpoint",
    "restore_checkpoint_state",
    "BatchedMuon",
    "LIGHTNING_RECOUNTS_EPOCH_END",
    "LIGHTNING_REKEYS_BY_MODEL_ORDER",
    "LIGHTNING_VERSION",
    "TORCH_VERSION",
    "after_lightning_signal_handlers",
    "batches_that_stepped",
    "bind_manager_server",
    "checkpoint_state_key",
    "DDPOnTheTrainingStream",
    "collect_rng_states",
    "comm_hook",
    "compute_dtype",
    "dcp_full_state_planner",
    "dcp_private_metadata_classes",
    "dcp_entries",
    "dcp_storage_extents",
    "default_store",
    "default_hp_metric",
    "disable_sigterm_broadcast",
    "exit_now",
    "fault_tolerant_ddp",
    "flatten_hparams",
    "hpc_save_path",
    "install_resume_resolver",
    "is_object_storage",
    "is_strided_shard",
    "last_saved_step",
    "log_metrics",
    "manager_binds_every_interface",
    "loop_progress",
    "next_train_batch",
    "optimizer_steps",
    "process_group_backend",
    "rekey_optimizer_states_by_groups",
    "pending_train_step_log",
    "restore_loop_position",
    "reposition_train_loaders",
    "restore_train_loaders",
    "save_last_checkpoint",
    "set_batches_that_stepped",
    "set_loop_progress",
    "set_model_parallel_sizes",
    "set_optimizer_steps",
    "set_process_group_timeout",
    "set_rng_states",
    "set_strategy_timeout",
    "should_accumulate",
    "should_update_logs",
    "show_resumed_epoch",
    "stock_hook_survives_failed_allreduce",
    "fix_last_batch_restart",
    "strategy_timeout",
    "tensorboard_hparams",
    "sampler_state",
    "loader_workers",
    "muon_per_matrix",
    "worker_seed",
    "strided_rows_survive_linear",
    "strided_shard",
    "tensorboard_file_writer",
    "threads_like_rank_zero",
    "torch_muon_is_batched",
    "train_loader_states",
    "train_loaders",
    "uncount_batch",
    "undo_epoch_end_recount",
    "validation_due",
    "wait_for_async_writes",
]
