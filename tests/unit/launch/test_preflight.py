"""lit_ddp.launch.preflight: the checks before anything starts. The launch layout against fake Slurm and
torchrun environments (no cluster needed), the machine, the config files, and a ``--ckpt_path`` against the
config; each bad case is refused with one line that names the fix."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lit_ddp.cli import cli_main
from lit_ddp.errors import UsageError
from lit_ddp.launch.preflight import check_launch, check_pipeline, check_replica_group, check_trainer
from lit_ddp.launch.reporting import USAGE_EXIT_CODE
from tests.helpers import QUIET, SLURM_PLUGIN, SRUN_2, SRUN_CONFIGS, compose, usage_error, without

GOOD = {
    "no Slurm, no plugin": ({}, {"devices": 2}),
    "srun, plugin": (SRUN_2, {"devices": 2, "num_nodes": 1, "plugins": SLURM_PLUGIN}),
    "srun, detected": (SRUN_2, {"devices": "2", "num_nodes": 1}),
    "srun, devices auto": (SRUN_2, {"devices": "auto", "plugins": SLURM_PLUGIN}),
    "torchrun in a job": (
        {**without(SRUN_2, "SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS": "1", "TORCHELASTIC_RUN_ID": "7"},
        {"devices": 2},
    ),
    "torchrun restarts, a store per round": (
        {"TORCHELASTIC_RUN_ID": "7", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "False"},
        {"devices": 2},
    ),
    "torchrun shared store, no restarts": (
        {"TORCHELASTIC_RUN_ID": "7", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},
        {"devices": 2},
    ),
    "srun, one GPU per task": (
        {**SRUN_2, "SLURM_GPUS_ON_NODE": "2"},
        {"devices": 2, "accelerator": "gpu", "plugins": SLURM_PLUGIN},
    ),
    "srun on CPU, GPUs on the node": ({**SRUN_2, "SLURM_GPUS_ON_NODE": "1"}, {"devices": 2, "accelerator": "cpu"}),
    "interactive shell, one task": (
        {**SRUN_2, "SLURM_JOB_NAME": "bash", "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"},
        {"devices": 2},
    ),
    "batch script, one task": (
        without(
            {**SRUN_2, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"}, "SLURM_STEP_ID", "SLURM_STEP_TASKS_PER_NODE"
        ),
        {"devices": 1},
    ),
}

BAD = {
    "srun -n 2": (
        without({**SRUN_2}, "SLURM_NTASKS_PER_NODE"),
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"--ntasks=2 .*`--nodes 1 --ntasks-per-node=2` instead of `-n 2`",
    ),
    "ntasks-per-node 1, devices 2": (
        {**SRUN_2, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_TASKS_PER_NODE": "1"},
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"--ntasks-per-node=1\) but trainer.devices=2.*--ntasks-per-node=2 or pass --trainer.devices 1",
    ),
    "detected, devices list": (
        SRUN_2,
        {"devices": [0, 1, 2]},
        r"--ntasks-per-node=2\) but trainer.devices=\[0, 1, 2\]",
    ),
    "nodes 1, num_nodes 2": (
        SRUN_2,
        {"devices": 2, "num_nodes": 2, "plugins": SLURM_PLUGIN},
        r"--nodes=1\) but trainer.num_nodes=2.*--nodes=2 or pass --trainer.num_nodes 1",
    ),
    "srun bash -c": (
        {**SRUN_2, "SLURM_JOB_NAME": "bash"},
        {"devices": 2},
        r"runs 2 tasks but the job is named 'bash'.*srun -J",
    ),
    "batch script without srun": (
        without(SRUN_2, "SLURM_STEP_ID", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES"),
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"SLURM_NTASKS=2, not an srun step.*Prepend srun",
    ),
    "plugin outside Slurm": ({}, {"devices": 2, "plugins": SLURM_PLUGIN}, r"not a Slurm job.*sbatch slurm/train"),
    "plugin under torchrun": (
        {"TORCHELASTIC_RUN_ID": "7"},
        {"devices": 2, "plugins": SLURM_PLUGIN},
        r"started by torchrun.*SLURMEnvironment",
    ),
    "srun, fewer GPUs than tasks": (
        {**SRUN_2, "SLURM_GPUS_ON_NODE": "1"},
        {"devices": 2, "accelerator": "gpu", "plugins": SLURM_PLUGIN},
        r"gave this node 1 GPU\(s\) .* runs 2 task\(s\).*--gres=gpu:2 or --ntasks-per-node=1",
    ),
    "torchrun restarts on a shared store": (
        {"TORCHELASTIC_RUN_ID": "7", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"},
        {"devices": 2},
        r"--max-restarts 3\) but shares its rendezvous store.*TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun",
    ),
}


@pytest.mark.parametrize("env,trainer", GOOD.values(), ids=GOOD.keys())
def test_good_launches_pass(env: dict, trainer: dict) -> None:
    check_launch(trainer, env)


@pytest.mark.parametrize("env,trainer,match", BAD.values(), ids=BAD.keys())
def test_bad_launches_name_the_fix(env: dict, trainer: dict, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        check_launch(trainer, env)


def test_cli_refuses_slurm_config_outside_slurm(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", *SRUN_CONFIGS, "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert exc.value.code == USAGE_EXIT_CODE
    assert "not a Slurm job" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing was started"


def test_check_trainer_uses_the_given_machine() -> None:
    check_trainer({"accelerator": "cpu", "devices": 8}, cpu_count=8, cuda_available=False)
    with pytest.raises(UsageError, match="trainer.devices=8 but this process may use 4 CPU core"):
        check_trainer({"accelerator": "cpu", "devices": 8}, cpu_count=4, cuda_available=False)
    with pytest.raises(UsageError, match="bf16-mixed"):
        check_trainer({"accelerator": "auto", "precision": "16-mixed"}, cpu_count=4, cuda_available=False)
    with pytest.raises(UsageError, match="trainer.accelerator=gpu but torch sees no CUDA GPU.*trainer.accelerator=cpu"):
        check_trainer({"accelerator": "gpu", "devices": -1}, cpu_count=4, cuda_available=False)
    check_trainer({"accelerator": "gpu", "devices": -1}, cpu_count=4, cuda_available=True)
    check_trainer({"accelerator": "auto", "devices": 8, "precision": "16-mixed"}, cpu_count=4, cuda_available=True)
    # torchrun started the 8 processes already (its --nproc_per_node): their number is the user's to choose
    torchrun = {"TORCHELASTIC_RUN_ID": "1"}
    check_trainer({"accelerator": "cpu", "devices": 8}, cpu_count=4, cuda_available=False, env=torchrun)
    # so did srun, each task bound to one core (srun --cpu-bind=cores -c 1): 2 tasks of 1 core each are fine
    check_trainer({"accelerator": "cpu", "devices": 2}, cpu_count=1, cuda_available=False, env={"SLURM_STEP_ID": "0"})
    with pytest.raises(UsageError, match="may use 1 CPU"):  # the batch shell of such a job is not a step
        check_trainer(
            {"accelerator": "cpu", "devices": 2}, cpu_count=1, cuda_available=False, env={"SLURM_JOB_ID": "7"}
        )


# ---- a checkpoint against the config, the config files


@pytest.fixture(scope="module")
def regression_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A regression checkpoint written with learning_rate 0.05 (one epoch, one process)."""
    root = tmp_path_factory.mktemp("regression")
    cli_main(["fit", *compose("regression/single_device"), "--trainer.max_epochs", "1", *QUIET,
              "--model.init_args.learning_rate", "0.05", "--trainer.default_root_dir", str(root)])  # fmt: skip
    return root / "checkpoints" / "last.ckpt"


def test_checkpoint_of_another_task_is_refused(regression_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    line = usage_error(capsys, "fit", *compose("trainer/ddp", "mingpt/cpu"), "--ckpt_path", str(regression_checkpoint))
    assert "lit_ddp.tasks.regression.RegressionModule" in line and "lit_ddp.tasks.mingpt.GPTModule" in line


def test_restored_hyperparameter_that_replaces_a_given_value_is_named(
    regression_checkpoint: Path, tmp_path: Path
) -> None:
    with pytest.warns(UserWarning, match=r"model.init_args.learning_rate=0.05 replaces the configured 0.001"):
        cli_main(["fit", *compose("regression/single_device"), "--ckpt_path", str(regression_checkpoint),
                  "--model.init_args.learning_rate", "0.001", "--trainer.max_epochs", "1", *QUIET,
                  "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip


def test_malformed_yaml_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  max_epochs: 3\n  devices: [1\n")
    line = usage_error(capsys, "fit", *compose("trainer/ddp", "regression/ddp"), "--config", str(bad))
    assert f"config {bad} is not valid YAML (line 4" in line


def test_the_core_check_counts_the_cpus_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm or container CPU binding (the process's affinity), not the machine's core count (issue 26)."""
    from lit_ddp.launch import preflight

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert preflight.usable_cpus() == 2
    with pytest.raises(UsageError, match=r"trainer.devices=3 but this process may use 2 CPU core\(s\)"):
        preflight.check_trainer({"devices": 3, "accelerator": "cpu"}, env={})


# ---- the rendezvous address


def test_an_unresolvable_master_addr_is_refused_at_once(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A MASTER_ADDR that names no host had every process retry it until the rendezvous timed out (more than 90 s
    measured, with torch's warnings); now one line before any process starts (issue 50, item 7)."""
    import time

    from lit_ddp.launch.preflight import check_master_addr

    for good in ("127.0.0.1", "localhost", "::1", ""):
        check_master_addr({"MASTER_ADDR": good})
    start = time.monotonic()
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")  # .invalid: a name no resolver answers (RFC 2606)
    line = usage_error(capsys, "fit", *compose("trainer/ddp", "regression/ddp"), *QUIET)
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve to an address" in line, line
    assert time.monotonic() - start < 30


def test_a_resolver_that_does_not_answer_is_refused_after_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import threading

    from lit_ddp.launch import preflight

    never = threading.Event()
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: never.wait(5))
    with pytest.raises(UsageError, match=r"MASTER_ADDR='node7' does not resolve .*no answer from the resolver within"):
        preflight.check_master_addr({"MASTER_ADDR": "node7"}, timeout=0.2)
    never.set()


FT_STRATEGY = {"class_path": "lit_ddp.ft.strategy.TorchFTStrategy"}


@pytest.mark.parametrize(
    ("strategy", "refused"),
    [
        (FT_STRATEGY, False),
        ({"class_path": "lit_ddp.strategies.FSDP2Strategy"}, True),
        ({"class_path": "lit_ddp.strategies.DDPStrategy"}, True),
        ("auto", True),
    ],
)
def test_a_replica_group_trains_with_the_torchft_strategy_only(strategy: object, refused: bool) -> None:
    """Under torchft's launcher ($TORCHFT_LIGHTHOUSE set) a config whose strategy is not TorchFTStrategy (a trainer
    fragment composed after torchft.yaml) is refused in one line naming it; outside the launcher nothing is."""
    env = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510"}
    trainer = {"strategy": strategy, "devices": 1}
    check_replica_group(trainer, {})
    if not refused:
        check_replica_group(trainer, env)
        return
    with pytest.raises(UsageError) as e:
        check_replica_group(trainer, env)
    name = strategy if isinstance(strategy, str) else strategy["class_path"]
    assert name in str(e.value) and "TorchFTStrategy" in str(e.value) and "\n" not in str(e.value)


PIPELINE = "lit_ddp.strategies.PipelineStrategy"


def pipeline_config(strategy: dict | None = None, model: dict | None = None, batch: int = 8, **trainer: object) -> dict:
    """A fit's parsed config under PipelineStrategy (its init_args ``strategy``): gpt-nano (3 blocks, 3 heads)."""
    return {
        "trainer": {"devices": 2, "num_nodes": 1, "strategy": {"class_path": PIPELINE, "init_args": strategy or {}},
                    **trainer},
        "model": {"class_path": "lit_ddp.tasks.mingpt.GPTModule", "init_args": {"model_type": "gpt-nano", **(model or {})}},
        "data": {"class_path": "lit_ddp.data.char.CharDataModule", "init_args": {"batch_size": batch}},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (pipeline_config({"schedule": "Zigzag"}), "trainer.strategy.init_args.schedule='Zigzag' is not one of GPipe,"),
        (pipeline_config({"schedule": "ZBVZeroBubble"}), "= 4 stages for a GPT of n_layer=3 blocks: give at most one"),
        (pipeline_config({"pipeline_parallel_size": 4}, devices=4), "4 x 1 stage(s) per rank (1F1B) = 4 stages for"),
        (pipeline_config(batch=6), "data.init_args.batch_size=6 does not split into trainer.strategy.init_args."),
        (pipeline_config({"n_microbatches": 1}), "n_microbatches=1: 1F1B needs at least one per stage (>= 2)"),
        (pipeline_config({"tensor_parallel_size": 2}, devices=2), "tensor_parallel_size=2 does not divide model.init_"),
        (pipeline_config({"tensor_parallel_size": 2}, {"n_head": 4}, devices=2), "x tensor_parallel_size=2 does not"),
        (pipeline_config(model={"compile": "blocks"}), "model.init_args.compile=blocks does not work with Pipeline"),
        (pipeline_config(precision="16-mixed"), "trainer.precision=16-mixed under PipelineStrategy"),
    ],
)
def test_a_pipeline_its_model_data_or_processes_cannot_run_is_refused(config: dict, says: str) -> None:
    with pytest.raises(UsageError) as refused:
        check_pipeline(config)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_pipeline_that_runs_and_other_strategies_pass() -> None:
    check_pipeline(pipeline_config())
    check_pipeline(pipeline_config({"schedule": "Interleaved1F1B"}, {"n_layer": 4}))
    check_pipeline(pipeline_config({"tensor_parallel_size": 2, "pipeline_parallel_size": 1}, {"n_head": 4}))
    check_pipeline(
        {**pipeline_config(batch=6), "trainer": {"strategy": {"class_path": "lit_ddp.strategies.DDPStrategy"}}}
    )


def test_lit_ddp_fit_refuses_a_bad_pipeline_before_anything_starts(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    line = usage_error(capsys, "fit", *compose("trainer/pp", "mingpt/cpu"), "--data.batch_size", "30",
                       "--trainer.default_root_dir", str(tmp_path), *QUIET)  # fmt: skip
    assert "batch_size=30 does not split into trainer.strategy.init_args.n_microbatches=4" in line
