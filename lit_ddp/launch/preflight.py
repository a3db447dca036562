"""The checks of the launch, the machine and the command line that run before any process starts: one error type,
one ``lit-ddp: error:`` line. (The text data and a checkpoint's model size are checked as early, in
:mod:`lit_ddp.launch.text_check` and :mod:`lit_ddp.launch.model_size`.)

Each check raises :class:`~lit_ddp.errors.UsageError` naming the bad value and what would be right; the CLI prints it
once (rank/task zero) as ``lit-ddp: error: ...`` and exits with status 2, before anything is instantiated, so
nothing already saved is touched and no process is left waiting for a peer (:func:`run_preflight`).

- the launch (:func:`check_launch`): the Slurm / torchrun mis-launches that otherwise hang or fail
  obscurely. Lightning joins processes that a launcher started (``srun`` -> ``SLURMEnvironment``,
  ``torchrun`` -> ``TorchElasticEnvironment``) only when the launcher's task layout matches
  ``trainer.devices`` (processes per node) and ``trainer.num_nodes``. The mistakes users make most:

  - ``srun -n 2`` without ``--ntasks-per-node``: ``SLURMEnvironment()`` raises inside config
    instantiation, which jsonargparse reports as "does not correspond to a subclass of ...", once per task.
  - ``--ntasks-per-node`` != ``trainer.devices`` or ``--nodes`` != ``trainer.num_nodes``: a traceback per task.
  - ``srun bash -c "python ..."``: the job is named ``bash``, which Lightning takes for an interactive
    session; Slurm is not detected and every task starts its own independent training into one directory.
  - ``python`` without ``srun`` in a batch script asking for several tasks: Slurm is detected, one process
    starts, and it waits forever for the others.
  - a config with the ``SLURMEnvironment`` plugin under ``torchrun``: the plugin overrides torchrun's ranks.
  - ``torchrun --max-restarts N`` (N > 0) without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torch >= 2.5 shares
    the agent's store with the workers, and a restart reuses it (pytorch/pytorch#135712).
  - a Slurm node whose GPUs (``SLURM_GPUS_ON_NODE``) are not one per task.
- the trainer against this machine (:func:`check_trainer`): more CPU processes for Lightning to start than the
  cores this process may use (its CPU affinity: a container's binding), fp16 on CPU;
- a user-set ``MASTER_ADDR`` that does not resolve (:func:`check_master_addr`) and a ``MASTER_PORT`` that is busy
  (:func:`check_master_port`);
- a ``--config`` file that is not valid YAML (:func:`check_config_files`);
- an explicit ``--ckpt_path`` that is missing or not a complete checkpoint (:func:`check_ckpt_path`), or that
  another LightningModule than the config's wrote (:func:`check_ckpt_matches_config`);
- a pipeline (``PipelineStrategy``) the model, the data and the processes cannot run (:func:`check_pipeline`): an
  unknown schedule, more stages than blocks, a batch the microbatches do not divide, sizes the world size does not
  divide, ``compile``, fp16.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

import torch
import yaml
from lightning.pytorch.utilities import rank_zero_warn

from lit_ddp.errors import UsageError
from lit_ddp.launch.environment import config_value, devices_per_node, leading_int
from lit_ddp.models.gpt import PRESETS
from lit_ddp.models.parallelize import check_schedule, stages_per_rank_for
from lit_ddp.run_dir import layout, untrusted
from lit_ddp.run_dir.checkpoints import checkpoint_header, is_valid_checkpoint
from lit_ddp.run_dir.layout import last_checkpoint

INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # Lightning's ``_is_slurm_interactive_mode``
SHARED_STORE_BREAKS_RESTARTS_ON = "2.9.1, 2.13.0 and 2.15.0"
"""The torch versions on which a restarted group of plain torch breaks on torchrun's shared store, so that the
refusal of ``--max-restarts`` without the opt-out stands: measured by
``tests/system/test_reliability.py::test_torch_shared_store_still_breaks_restarts`` (``make test-torch TORCH=X``)."""


def _class_paths(plugins: Any) -> list[str]:
    """Class names of ``trainer.plugins`` given as a config (class_path dicts / Namespaces) or objects."""
    if plugins is None:
        return []
    items = plugins if isinstance(plugins, list | tuple) else [plugins]
    names = []
    for item in items:
        class_path = config_value(item, "class_path")
        names.append(str(class_path) if class_path is not None else type(item).__name__)
    return names


def check_launch(trainer: Any, env: Mapping[str, str] | None = None) -> None:
    """Checks the launch (environment variables of srun / sbatch / torchrun) against the trainer config.

    Args:
        trainer: the ``trainer`` section of the parsed config (a Namespace or a dict): ``devices``,
            ``num_nodes`` and ``plugins`` are read.
        env: the environment to check; defaults to ``os.environ``.

    Raises:
        UsageError: the first mismatch found, with what would be right.
    """
    env = os.environ if env is None else env
    slurm_plugin = any(
        p.rsplit(".", 1)[-1] == "SLURMEnvironment" for p in _class_paths(config_value(trainer, "plugins"))
    )
    in_job = "SLURM_JOB_ID" in env
    in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    job_name = env.get("SLURM_JOB_NAME", "")
    interactive = job_name in INTERACTIVE_JOB_NAMES
    ntasks = leading_int(env.get("SLURM_NTASKS"))
    launch_hint = "srun -J NAME --nodes N --ntasks-per-node D python -m lit_ddp fit --config CONFIG"

    if "TORCHELASTIC_RUN_ID" in env:
        if slurm_plugin:
            raise UsageError(
                "This process was started by torchrun, but the config sets trainer.plugins=SLURMEnvironment, which "
                "would take the ranks from Slurm instead of torchrun. Under torchrun use a config without that "
                "plugin (e.g. configs/regression/torchrun.yaml, or pass --trainer.plugins null); for Slurm's "
                "requeue launch python directly: slurm/train.sbatch."
            )
        restarts = leading_int(env.get("TORCHELASTIC_MAX_RESTARTS")) or 0
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restarts > 0:
            # Why not a per-restart key prefix in the shared store: the workers cannot agree on one. Each agent
            # counts its own restarts and does not count one for a node re-joining (torch's agent api.py), so
            # two nodes' TORCHELASTIC_RESTART_COUNT differ after a hung worker. The opt-out gives every
            # rendezvous round a fresh store.
            raise UsageError(
                f"torchrun may restart this job (--max-restarts {restarts}) but shares its rendezvous store with "
                "the workers: a restarted group would read the stopped group's keys and hang or fail to connect "
                "(pytorch/pytorch#135712). Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
                "environment (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ...`; slurm/train_elastic.sbatch "
                f"sets it), which torch {SHARED_STORE_BREAKS_RESTARTS_ON} are known to need (this is torch "
                f"{torch.__version__}), or with --max-restarts 0."
            )
        return  # TorchElasticEnvironment: torchrun's --nproc_per_node / --nnodes decide

    if slurm_plugin and not in_job:
        raise UsageError(
            "The config sets trainer.plugins=SLURMEnvironment but this is not a Slurm job (no SLURM_JOB_ID). "
            f"Submit it with `sbatch slurm/train.sbatch CONFIG` or run `{launch_hint}`; without Slurm use a "
            "config without that plugin (e.g. configs/regression/ddp.yaml)."
        )
    if not in_job:
        return

    if in_step and interactive and (ntasks or 1) > 1:
        raise UsageError(
            f"This job step runs {ntasks} tasks but the job is named {job_name!r}, which Lightning takes for an "
            "interactive session: it would not use Slurm's ranks and every task would start its own training. "
            "Give the job another name (`srun -J train ...`) or launch python directly instead of through a "
            f"shell: `{launch_hint}`."
        )
    if not in_step and not interactive and (ntasks or 1) > 1:
        assert ntasks is not None  # (ntasks or 1) > 1
        raise UsageError(
            f"This is the batch script of a job with SLURM_NTASKS={ntasks}, not an srun step: only this one process "
            f"would start and it would wait forever for the other {ntasks - 1}. Prepend srun: "
            "`srun python -m lit_ddp fit ...` (as slurm/train.sbatch does)."
        )

    # Lightning uses SLURMEnvironment when the config names it or when srun started this process.
    if not slurm_plugin and (interactive or ntasks is None):
        return
    if (ntasks or 1) > 1 and "SLURM_NTASKS_PER_NODE" not in env:
        assert ntasks is not None  # (ntasks or 1) > 1
        nodes = leading_int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")) or 1
        raise UsageError(
            f"The job was launched with --ntasks={ntasks} (e.g. `srun -n {ntasks}`) but without --ntasks-per-node, "
            "which Lightning's SLURMEnvironment needs: one task per device on each node. Use "
            f"`--nodes {nodes} --ntasks-per-node={max(1, ntasks // nodes)}` instead of `-n {ntasks}`."
        )
    per_node = leading_int(env.get("SLURM_STEP_TASKS_PER_NODE") if in_step else None) or leading_int(
        env.get("SLURM_NTASKS_PER_NODE")
    )
    devices = config_value(trainer, "devices")
    want = devices_per_node(devices)
    if per_node is not None and want is not None and per_node != want:
        raise UsageError(
            f"Slurm started {per_node} task(s) per node (--ntasks-per-node={per_node}) but trainer.devices={devices}: "
            f"Lightning needs one task per device. Either launch with --ntasks-per-node={want} or pass "
            f"--trainer.devices {per_node}."
        )
    gpus = leading_int(env.get("SLURM_GPUS_ON_NODE"))
    accelerator = str(config_value(trainer, "accelerator", "auto") or "auto").lower()
    if per_node is not None and gpus and accelerator != "cpu" and gpus != per_node:
        raise UsageError(
            f"Slurm gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE={gpus}) but runs {per_node} task(s) on it "
            f"(--ntasks-per-node={per_node}): Lightning runs one task per GPU. Launch with --gres=gpu:{per_node} "
            f"or --ntasks-per-node={gpus}."
        )
    num_nodes = int(config_value(trainer, "num_nodes", 1) or 1)
    nnodes = leading_int(env.get("SLURM_STEP_NUM_NODES") if in_step else None) or leading_int(env.get("SLURM_NNODES"))
    if nnodes is not None and nnodes != num_nodes:
        raise UsageError(
            f"The job runs on {nnodes} node(s) (--nodes={nnodes}) but trainer.num_nodes={num_nodes}. Either "
            f"launch with --nodes={num_nodes} or pass --trainer.num_nodes {nnodes}."
        )


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a Slurm or container CPU binding), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def check_trainer(
    trainer: Any,
    cpu_count: int | None = None,
    cuda_available: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Checks ``trainer.devices`` and ``trainer.precision`` against this machine before any process starts.
    Under torchrun (``TORCHELASTIC_RUN_ID`` in ``env``) or in an srun step (``SLURM_STEP_ID``) the processes
    exist already, as many as the launcher asked for, each bound to the cores it was given: more of them than
    one process's cores is the launcher's layout, not a typo.

    Raises:
        UsageError: a GPU accelerator where torch sees no CUDA GPU, more CPU processes than cores (Lightning to
            start them), or ``16-mixed`` / ``16`` precision on CPU.
    """
    if trainer is None:
        return
    cpu_count = usable_cpus() if cpu_count is None else cpu_count
    cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
    accelerator = str(config_value(trainer, "accelerator", "auto") or "auto").lower()
    if accelerator in ("gpu", "cuda") and not cuda_available:
        raise UsageError(
            f"trainer.accelerator={accelerator} but torch sees no CUDA GPU on this machine (torch "
            f"{torch.__version__}): leave out configs/trainer/gpu.yaml, or set trainer.accelerator=cpu"
        )
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not cuda_available)
    if not on_cpu:
        return
    devices = config_value(trainer, "devices", "auto")
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    env = os.environ if env is None else env
    # torchrun or srun started the processes already, each perhaps bound to fewer cores than the node's
    # devices (srun --cpu-bind=cores -c 1): their number is the launcher's, not a typo.
    launched = "TORCHELASTIC_RUN_ID" in env or "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    if isinstance(devices, int) and devices > cpu_count and not launched:
        raise UsageError(
            f"trainer.devices={devices} but this process may use {cpu_count} CPU core(s): on CPU each device is one "
            f"process, so use trainer.devices <= {cpu_count} (or trainer.accelerator=gpu on a GPU machine)"
        )
    precision = str(config_value(trainer, "precision", None))
    if precision in ("16-mixed", "16", "16-true"):
        raise UsageError(
            f"trainer.precision={precision} is for GPUs; on CPU use trainer.precision=bf16-mixed or 32-true"
        )


def check_master_port(env: dict[str, str] | None = None) -> None:
    """Checks that a user-set ``MASTER_PORT`` is free before Lightning launches its DDP processes.

    Only for the process that launches the others itself (not under torchrun, srun, or in a launched
    child), since there the port is legitimately held by the launcher or rank 0. Without this check Lightning
    fails in rank 0 and leaves its already launched second process waiting for a peer.

    Raises:
        UsageError: the port is in use.
    """
    env = dict(os.environ) if env is None else env
    port = env.get("MASTER_PORT")
    launched = any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_STEP_ID"))
    if port is None or launched:
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"MASTER_PORT={port!r} is not a TCP port number (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((env.get("MASTER_ADDR", "127.0.0.1"), int(port)))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return
            raise UsageError(
                f"MASTER_PORT={port} is already in use by another process (an earlier run still alive?); "
                "pick a free port, e.g. MASTER_PORT=29511, or unset MASTER_PORT and Lightning finds one"
            ) from None


RESOLVE_TIMEOUT = 10.0
"""Seconds :func:`check_master_addr` waits for ``MASTER_ADDR`` to resolve (a resolver that does not answer)."""


def check_master_addr(env: Mapping[str, str] | None = None, timeout: float = RESOLVE_TIMEOUT) -> None:
    """Checks that a set ``MASTER_ADDR`` resolves to an address, within ``timeout`` seconds: every process would
    otherwise retry the name until the rendezvous timed out (minutes), printing torch's warnings.

    Raises:
        UsageError: the name does not resolve, or the resolver did not answer in time.
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR")
    if not addr:  # unset or empty: loopback (lit_ddp.launch.loopback)
        return
    failed: list[str] = []
    done = threading.Event()

    def resolve() -> None:
        try:
            socket.getaddrinfo(addr.strip("[]"), None)
        except (OSError, UnicodeError) as e:
            failed.append(str(getattr(e, "strerror", None) or e))
        done.set()

    threading.Thread(target=resolve, name="resolve MASTER_ADDR", daemon=True).start()
    if not done.wait(timeout):
        failed.append(f"no answer from the resolver within {timeout:g} s")
    if failed:
        raise UsageError(
            f"MASTER_ADDR={addr!r} does not resolve to an address ({failed[0]}): give the host name or IP address "
            "of the machine of rank zero (127.0.0.1 on one machine), or unset it"
        )


def check_ckpt_path(ckpt_path: str | None) -> None:
    """Checks an explicit ``--ckpt_path`` before training starts (Lightning would fail after launching).

    Raises:
        UsageError: the file does not exist, or is truncated / not a torch checkpoint.
        UntrustedFileError: a URL, or a sharded checkpoint whose metadata holds more than its own classes.
    """
    if ckpt_path is None or ckpt_path in layout.CKPT_PATH_KEYWORDS:
        return
    import fsspec

    untrusted.refuse_url(ckpt_path, "--ckpt_path")
    fs, path = fsspec.core.url_to_fs(str(ckpt_path))
    if not fs.exists(path):
        raise UsageError(
            f"--ckpt_path {ckpt_path} does not exist; give a .ckpt file of a run (e.g. {last_checkpoint('<run>')})"
        )
    if not is_valid_checkpoint(str(ckpt_path)):
        raise UsageError(
            f"--ckpt_path {ckpt_path} is truncated or not a checkpoint (not a complete torch.save archive, nor a "
            "sharded checkpoint's directory with all its shards); pick another .ckpt from the run's checkpoints/ directory"
        )


def check_replica_group(trainer: Any, env: Mapping[str, str] | None = None) -> None:
    """Raises UsageError where torchft's launcher started this process (``$TORCHFT_LIGHTHOUSE`` set: a replica group)
    but the config's strategy is not :class:`lit_ddp.ft.strategy.TorchFTStrategy`: the group would train alone,
    outside the quorum (FSDP2 or tensor parallelism within a group: not built here; a group is one process or DDP)."""
    env = os.environ if env is None else env
    strategy = config_value(trainer, "strategy")
    name = str(config_value(strategy, "class_path") or strategy)
    if "TORCHFT_LIGHTHOUSE" in env and not name.endswith("TorchFTStrategy"):
        raise UsageError(
            f"python -m lit_ddp.ft.launch started this replica group but trainer.strategy is {name}: a group trains "
            "with lit_ddp.ft.strategy.TorchFTStrategy (compose configs/trainer/torchft.yaml after the other trainer "
            "fragments); within a group, one process or DDP (--nproc_per_group), not FSDP2 or tensor parallelism"
        )


def run_preflight(trainer: Any, env: Mapping[str, str] | None = None) -> None:
    """The checks of the trainer config, in the order a user meets the problems: replica group, launch, machine,
    address, port.
    (``--ckpt_path`` is checked earlier, when the CLI parses it: :func:`check_ckpt_path`.)

    Args:
        trainer: the ``trainer`` section of the parsed config (a Namespace or a dict).
        env: the environment; defaults to ``os.environ``.

    Raises:
        UsageError: the first problem found.
    """
    check_replica_group(trainer, env)
    check_launch(trainer, env)
    check_trainer(trainer, env=env)
    check_master_addr(env)
    check_master_port(None if env is None else dict(env))


def check_config_files(argv: list[str]) -> None:
    """Parses every ``--config FILE`` of ``argv`` as YAML first, so a syntax error names its file and line
    (jsonargparse's message names neither when several configs are given). Missing files are left to the
    parser, which names them.

    Raises:
        UsageError: a file that is not valid YAML.
    """
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            continue
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                yaml.safe_load(f)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "somewhere"
            problem = getattr(e, "problem", None) or str(e)
            raise UsageError(f"config {path} is not valid YAML ({where}): {problem}") from None


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, list | tuple) else value


def check_ckpt_matches_config(ckpt_path: str | None, model_config: Any) -> None:
    """Checks an explicit ``--ckpt_path`` against the config's model before anything is built (reading only
    the checkpoint's small ``data.pkl`` record). LightningCLI re-parses the checkpoint's hyperparameters over
    the config: a checkpoint of another task would silently build that task's model; a saved value
    silently replaces the one given. The first is refused, the second warned about, key by key.

    Raises:
        UsageError: the checkpoint was written by another LightningModule than the config's ``model``.
    """
    if ckpt_path is None or ckpt_path in layout.CKPT_PATH_KEYWORDS or model_config is None:
        return
    hparams = checkpoint_header(str(ckpt_path)).get("hyper_parameters") or {}
    saved_class = hparams.get("_class_path")
    class_path = config_value(model_config, "class_path")
    if saved_class and class_path and saved_class != class_path:
        raise UsageError(
            f"--ckpt_path {ckpt_path} is a checkpoint of {saved_class}, but the config trains {class_path}: "
            "give a checkpoint of the same task, or the config of the task that wrote it"
        )
    init_args = config_value(model_config, "init_args") or {}
    for key, saved in hparams.items():
        if key.startswith("_") or key == "vocab":
            continue
        given = config_value(init_args, key, saved)
        if _plain(given) != _plain(saved):
            rank_zero_warn(
                f"--ckpt_path {ckpt_path}: the checkpoint's model.init_args.{key}={saved!r} replaces the "
                f"configured {given!r} (LightningCLI restores a checkpoint's hyperparameters)"
            )


PIPELINE_STRATEGY = "PipelineStrategy"
"""The class name of :class:`lit_ddp.strategies.PipelineStrategy` (named, not imported: the strategies import the
launch layer)."""


def check_pipeline(config: Any, training: bool = True) -> None:
    """Checks a ``PipelineStrategy`` config against its model, data and processes before any process starts (the
    strategy would refuse each once every process has started, or torch's schedule in the middle of the first step).
    Other strategies: nothing.

    Args:
        config: the parsed config of the subcommand (``trainer``, ``model``, ``data``; Namespaces or dicts).
        training: ``fit`` (a batch must split into the microbatches); evaluation takes batches of any size.

    Raises:
        UsageError: an unknown schedule, stages per rank or microbatches the schedule cannot run, more stages than
            the GPT has blocks, a ``data.batch_size`` that ``n_microbatches`` does not divide (training), a world size (nodes x
            devices) that ``pipeline_parallel_size`` x ``tensor_parallel_size`` does not divide, ``n_head`` that
            ``tensor_parallel_size`` does not divide, ``model.compile`` set, fp16 precision.
    """
    trainer = config_value(config, "trainer")
    strategy = config_value(trainer, "strategy")
    if str(config_value(strategy, "class_path", "")).rsplit(".", 1)[-1] != PIPELINE_STRATEGY:
        return
    args = config_value(strategy, "init_args") or {}
    pp = int(config_value(args, "pipeline_parallel_size", 2))
    tp = int(config_value(args, "tensor_parallel_size", 1))
    m = int(config_value(args, "n_microbatches", 4))
    schedule = str(config_value(args, "schedule", "1F1B"))
    prefix = "trainer.strategy.init_args."
    try:
        per_rank = stages_per_rank_for(schedule, config_value(args, "stages_per_rank"))
        check_schedule(schedule, pp, m, per_rank)
    except ValueError as e:
        raise UsageError(f"{prefix}{e}") from None
    model = config_value(config_value(config, "model"), "init_args") or {}
    preset = PRESETS.get(str(config_value(model, "model_type", "gpt-mini")), {})
    n_layer = config_value(model, "n_layer") or preset.get("n_layer")
    if n_layer is not None and pp * per_rank > int(n_layer):
        raise UsageError(
            f"{prefix}pipeline_parallel_size={pp} x {per_rank} stage(s) per rank ({schedule}) = {pp * per_rank} "
            f"stages for a GPT of n_layer={n_layer} blocks: give at most one stage per block (fewer ranks, a schedule "
            "with fewer stages per rank, or a larger model.init_args.n_layer)"
        )
    n_head = config_value(model, "n_head") or preset.get("n_head")
    if tp > 1 and n_head is not None and int(n_head) % tp:
        raise UsageError(f"{prefix}tensor_parallel_size={tp} does not divide model.init_args.n_head={n_head}")
    batch = config_value(config_value(config_value(config, "data"), "init_args") or {}, "batch_size")
    if training and batch is not None and int(batch) % m:
        raise UsageError(
            f"data.init_args.batch_size={batch} does not split into {prefix}n_microbatches={m}: give a batch size "
            f"that is a multiple of it (each rank's batch is cut into equal microbatches)"
        )
    devices = devices_per_node(config_value(trainer, "devices"))
    nodes = int(config_value(trainer, "num_nodes", 1) or 1)
    if devices is not None and (devices * nodes) % (pp * tp):
        raise UsageError(
            f"{prefix}pipeline_parallel_size={pp} x tensor_parallel_size={tp} does not divide the {devices * nodes} "
            f"processes (trainer.devices={devices} x trainer.num_nodes={nodes}): give sizes whose product divides them"
        )
    if compile_choice := config_value(model, "compile"):
        raise UsageError(
            f"model.init_args.compile={compile_choice} does not work with PipelineStrategy (its stages run under "
            "torch's pipeline schedule, not the module's forward): give false"
        )
    precision = str(config_value(trainer, "precision", None))
    if precision.startswith("16"):
        raise UsageError(
            f"trainer.precision={precision} under PipelineStrategy: its loss scaler would not see the schedule's "
            "backward; use bf16-mixed or 32-true"
        )
