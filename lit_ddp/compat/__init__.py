"""Every use of Lightning's and torch's private internals, in one place: ``lightning.py`` (every read or write of
another object's private attribute), ``lightning_names.py`` (Lightning's private functions and methods) and
``torch.py`` (torch's private functions), re-exported here (``from lit_ddp import compat; compat.should_accumulate(trainer)``).

Each function names what it works around (an upstream issue or PR where there is one); a workaround of a bug states
the torch or Lightning versions known to have it and turns itself off where a version has fixed it (by a version
flag, or by checking the state it mends). ``tests/unit/test_compat.py`` checks on any version that each internal
is still there and whether each bug still is; ``make test-torch TORCH=X`` runs it on another torch, and
docs/development.md tabulates the workarounds and their versions. Private names are imported inside the function
that uses them (:func:`~lit_ddp.compat.imports.private`): a version that renames one fails that function, naming
the version and what is missing, and not every command at import. Nothing else in the package touches another
object's ``_private`` attribute.
"""

from lit_ddp.compat.imports import LIGHTNING_VERSION, TORCH_VERSION
from lit_ddp.compat.lightning import (
    LIGHTNING_RECOUNTS_EPOCH_END,
    LIGHTNING_REKEYS_BY_MODEL_ORDER,
    after_lightning_signal_handlers,
    batches_that_stepped,
    checkpoint_state_key,
    collect_rng_states,
    default_hp_metric,
    disable_sigterm_broadcast,
    exit_now,
    fix_last_batch_restart,
    flatten_hparams,
    hpc_save_path,
    install_resume_resolver,
    last_saved_step,
    log_metrics,
    pending_train_step_log,
    rekey_optimizer_states_by_groups,
    restore_train_loaders,
    save_last_checkpoint,
    set_batches_that_stepped,
    set_model_parallel_sizes,
    set_rng_states,
    set_strategy_timeout,
    should_accumulate,
    should_update_logs,
    tensorboard_file_writer,
    tensorboard_hparams,
    train_loader_states,
    train_loaders,
    undo_epoch_end_recount,
    validation_due,
    wait_for_async_writes,
)
from lit_ddp.compat.lightning_names import (
    DDPOnTheTrainingStream,
    compute_dtype,
    is_object_storage,
    restore_loop_position,
    show_resumed_epoch,
    strategy_timeout,
    threads_like_rank_zero,
)
from lit_ddp.compat.torch import (
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

__all__ = [
    "LIGHTNING_RECOUNTS_EPOCH_END",
    "LIGHTNING_REKEYS_BY_MODEL_ORDER",
    "LIGHTNING_VERSION",
    "TORCH_VERSION",
    "after_lightning_signal_handlers",
    "batches_that_stepped",
    "checkpoint_state_key",
    "DDPOnTheTrainingStream",
    "collect_rng_states",
    "compute_dtype",
    "dcp_storage_extents",
    "default_store",
    "default_hp_metric",
    "disable_sigterm_broadcast",
    "exit_now",
    "flatten_hparams",
    "hpc_save_path",
    "install_resume_resolver",
    "is_object_storage",
    "is_strided_shard",
    "last_saved_step",
    "log_metrics",
    "rekey_optimizer_states_by_groups",
    "pending_train_step_log",
    "restore_loop_position",
    "restore_train_loaders",
    "save_last_checkpoint",
    "set_batches_that_stepped",
    "set_model_parallel_sizes",
    "set_process_group_timeout",
    "set_rng_states",
    "set_strategy_timeout",
    "should_accumulate",
    "should_update_logs",
    "show_resumed_epoch",
    "fix_last_batch_restart",
    "strategy_timeout",
    "tensorboard_hparams",
    "sampler_state",
    "loader_workers",
    "worker_seed",
    "strided_rows_survive_linear",
    "strided_shard",
    "tensorboard_file_writer",
    "threads_like_rank_zero",
    "train_loader_states",
    "train_loaders",
    "undo_epoch_end_recount",
    "validation_due",
    "wait_for_async_writes",
]
