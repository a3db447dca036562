"""The checks of the launch, the machine and the command line that run before any process starts: one error type,
one ``lit-ddp: error:`` line. :func:`run_checks` lists every one of them in the order they run, each once per
command; the text data, a checkpoint's model size and the launchers' variables are checked in modules of their own
(:mod:`lit_ddp.launch.text_check`, :mod:`lit_ddp.launch.model_size`, :mod:`lit_ddp.launch.variables`).

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

from lit_ddp.errors import DamagedCheckpointError, UsageError
from lit_ddp.launch.environment import config_value, devices_per_node, leading_int
from lit_ddp.models.gpt import PRESETS
from lit_ddp.models.parallelize import check_schedule, stages_per_rank_for
from lit_ddp.run_dir import layout, untrusted
from lit_ddp.run_dir.checkpoints import checkpoint_header, why_not_valid
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
        UsageError: a GPU accelerator where torch sees no CUDA GPU, fewer than one or more CPU processes than
            cores (Lightning to start them), or ``16-mixed`` / ``16`` precision on CPU.
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
    if isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, int) and devices < 1:  # -1, "every GPU", has no meaning on CPU
        raise UsageError(
            f"trainer.devices={devices}: on CPU each device is one process; give a number >= 1 (at most "
            f"{cpu_count} here), or auto"
        )
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
    if not addr:  # unset or empty: loopback (lit_ddp.strategies.loopback)
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
        DamagedCheckpointError: its bytes do not match the digests written with them (the record or shard entry and
            the tensor named).
        UntrustedFileError: a URL, not a regular file, a file holding more than tensors and plain data (or more than
            this machine can hold), or a sharded checkpoint whose metadata holds more than its own classes.
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
    why = why_not_valid(str(ckpt_path))
    if why is not None and why.startswith("is damaged"):
        raise DamagedCheckpointError(
            f"--ckpt_path {ckpt_path} {why}; it is not loaded: pick another .ckpt from the run's checkpoints/ "
            "directory (an older one, or a copy of this one from elsewhere)"
        )
    if why is not None:
        detail = why.removeprefix("is truncated or unreadable").strip()
        raise UsageError(
            f"--ckpt_path {ckpt_path} is truncated or not a checkpoint {detail}: not a complete torch.save archive, nor "
            "a sharded checkpoint's directory with all its shards; pick another .ckpt from the run's checkpoints/ "
            "directory"
        )
    if "://" not in str(ckpt_path) and os.path.isfile(ckpt_path):
        # LightningCLI loads a file's hyperparameters right after parsing (weights-only, with a traceback where it
        # refuses): the same load, memory-mapped (no tensor read), says it in one line first.
        untrusted.load(str(ckpt_path), mmap=True)


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


STAGES = ("arguments", "parsed", "built")
"""Where the CLI runs :func:`run_checks`: on the command line before the config is parsed, on the parsed config before
LightningCLI reads ``--ckpt_path``, and before anything is instantiated."""


def run_checks(
    stage: str, argv: list[str] | None = None, config: Any = None, training: bool = True
) -> dict[str, Any] | None:
    """Every check lit-ddp makes before anything starts, in the order a user meets the problems; the CLI calls it
    at each of :data:`STAGES`, when the checks' inputs exist:

    ``"arguments"`` (``argv``: the command line, before the config is parsed)
      1. the launchers' integer variables (:func:`lit_ddp.launch.variables.check_launch_variables`; ``python -m
         lit_ddp`` ran it before Lightning was imported, and it runs once per process);
      2. every ``--config`` file is valid YAML (:func:`check_config_files`);
    ``"parsed"`` (``config``: the subcommand's parsed config, before LightningCLI reads ``--ckpt_path``)
      3. ``--weights_only`` is not false;
      4. ``--ckpt_path`` exists, is whole and loads weights-only (:func:`check_ckpt_path`);
      5. its hyperparameters are the configured task's own arguments (:func:`check_ckpt_matches_config`);
    ``"built"`` (``config``: the subcommand's config, before anything is instantiated)
      6. a torchft replica group names its strategy (:func:`check_replica_group`);
      7. the launch: torchrun's and srun's layouts against the config (:func:`check_launch`);
      8. the machine: devices, precision (:func:`check_trainer`);
      9. ``MASTER_ADDR`` resolves and ``MASTER_PORT`` is free (:func:`check_master_addr`, :func:`check_master_port`);
      10. a pipeline's schedule, stages and microbatches fit its model, batch and processes (:func:`check_pipeline`;
          ``training``: ``fit``, whose batches the microbatches split);
      11. ``--ckpt_path``'s tensors fit the model the config builds (:func:`lit_ddp.launch.model_size.check_ckpt_builds_model`);
      12. the text the data module reads is UTF-8 (:func:`lit_ddp.launch.text_check.check_text_data`).

    Returns:
        at ``"parsed"``, ``--ckpt_path``'s header where one is given (read once: the resume takes its step), else None.

    Raises:
        UsageError: the first problem found (an ``UntrustedFileError`` for a refused file).
    """
    from lit_ddp.launch.variables import check_launch_variables
    from lit_ddp.run_dir.untrusted import UntrustedFileError

    if stage == "arguments":
        check_launch_variables()
        check_config_files(list(argv or []))
        return None
    if stage == "parsed":
        if config.get("weights_only") is False:
            raise UntrustedFileError(
                "--weights_only false: lit-ddp loads checkpoints weights-only (tensors and plain data), whatever "
                "their source (docs/security.md); a checkpoint you trust that holds other objects: load it with "
                "torch.load(weights_only=False) yourself and save what it holds as tensors"
            )
        ckpt_path = config.get("ckpt_path")
        check_ckpt_path(ckpt_path)
        header = None
        if ckpt_path is not None and ckpt_path not in layout.CKPT_PATH_KEYWORDS:
            header = checkpoint_header(str(ckpt_path))
        check_ckpt_matches_config(ckpt_path, config.get("model"), header)
        return header
    if stage == "built":
        from lit_ddp.launch.model_size import check_ckpt_builds_model
        from lit_ddp.launch.text_check import check_text_data

        run_preflight(config.get("trainer"))
        check_pipeline(config, training=training)
        check_ckpt_builds_model(config.get("ckpt_path"), config.get("model"))
        check_text_data(config.get("data"))
        return None
    raise ValueError(f"run_checks: stage {stage!r} is not one of {STAGES}")


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


CLASS_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")
"""Keys with which jsonargparse imports and builds a class: a checkpoint's hyperparameters may not hold them."""
LIGHTNING_KEYS = ("_class_path", "_instantiator")
"""The keys LightningCLI adds to the hyperparameters it saves (the model's class; Lightning drops the second)."""


def check_ckpt_hparams(ckpt_path: str, hparams: Any, model_config: Any) -> None:
    """Checks that a checkpoint's ``hyper_parameters``, which LightningCLI parses over the config (and which would
    have jsonargparse import and build whatever class they name), hold only arguments of the configured class.

    Raises:
        UntrustedFileError: they are not a mapping; name a class (a ``class_path``, ``init_args`` or ``dict_kwargs``
            key anywhere, except a value the config gives that same argument); hold a key the configured class does
            not take; or, with no model class configured, name a class outside lit-ddp.
    """

    def refuse(why: str) -> untrusted.UntrustedFileError:
        return untrusted.UntrustedFileError(
            f"--ckpt_path {ckpt_path}: its hyper_parameters {why}; lit-ddp passes a checkpoint's hyperparameters to "
            "the configured model only as its own arguments (they would make jsonargparse import and build a class "
            "the file names): give a checkpoint of the configured model"
        )

    if not isinstance(hparams, dict):
        raise refuse(f"are a {type(hparams).__name__}, not a mapping")
    class_path = config_value(model_config, "class_path")
    init_args = config_value(model_config, "init_args") or {}
    saved_class = hparams.get("_class_path")
    if class_path is None and saved_class is not None and not str(saved_class).startswith("lit_ddp."):
        raise refuse(f"name the class {saved_class!r}, and the config names none (give --model {saved_class})")
    for key in CLASS_KEYS:
        if key in hparams:
            raise refuse(f"hold {key}={hparams[key]!r}")
    parameters = _init_parameters(class_path)
    for key, value in hparams.items():
        if key in LIGHTNING_KEYS:
            continue
        if parameters is not None and key not in parameters:
            raise refuse(f"hold {key}, which {class_path} does not take")
        if _names_a_class(value) and _plain(value) != _plain(config_value(init_args, key, None)):
            raise refuse(f"give {key} a class ({value!r})")


def _init_parameters(class_path: str | None) -> set[str] | None:
    """The arguments ``class_path``'s ``__init__`` takes (the config's class, which LightningCLI imports anyway);
    None where it takes any keyword or cannot be inspected."""
    if not class_path:
        return None
    import importlib
    import inspect

    module, _, name = str(class_path).rpartition(".")
    try:
        params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return set(params)


def _names_a_class(value: Any, max_items: int = 100_000) -> bool:
    """Whether ``value`` holds, at any depth, a mapping with one of :data:`CLASS_KEYS` (walked without recursion)."""
    pending, seen = [value], 0
    while pending and seen < max_items:
        item = pending.pop()
        seen += 1
        if isinstance(item, dict):
            if any(key in item for key in CLASS_KEYS):
                return True
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return bool(pending)  # too large to walk: treated as naming one


def check_ckpt_matches_config(ckpt_path: str | None, model_config: Any, header: dict[str, Any] | None = None) -> None:
    """Checks an explicit ``--ckpt_path`` against the config's model before anything is built (reading only
    the checkpoint's small ``data.pkl`` record). LightningCLI re-parses the checkpoint's hyperparameters over
    the config: a checkpoint of another task would silently build that task's model; a saved value
    silently replaces the one given; a planted one could name any class to import (:func:`check_ckpt_hparams`).
    The first and the last are refused, the second warned about, key by key.

    Raises:
        UsageError: the checkpoint was written by another LightningModule than the config's ``model``.
        UntrustedFileError: its hyperparameters name a class or hold what the configured class does not take.

    ``header``: the checkpoint's header where the caller read it already (else it is read here).
    """
    if ckpt_path is None or ckpt_path in layout.CKPT_PATH_KEYWORDS:
        return
    header = checkpoint_header(str(ckpt_path)) if header is None else header
    hparams = header.get("hyper_parameters") or {}
    saved_class = hparams.get("_class_path") if isinstance(hparams, dict) else None
    class_path = config_value(model_config, "class_path")
    if saved_class and class_path and saved_class != class_path:
        raise UsageError(
            f"--ckpt_path {ckpt_path} is a checkpoint of {saved_class}, but the config trains {class_path}: "
            "give a checkpoint of the same task, or the config of the task that wrote it"
        )
    check_ckpt_hparams(str(ckpt_path), hparams, model_config)
    if model_config is None:
        return
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
