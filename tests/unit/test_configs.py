"""The shipped configs: each parses, the README's commands compose them as documented, no config forces a
process-group backend, every multi-process composition has a collective timeout, no block is repeated, and the
minGPT step configs sample text and measure throughput with callbacks."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml

from lit_ddp.cli import cli_main
from tests.helpers import CONFIGS, REPO, documented_commands, main_job, noise_lines, page_figures, step_commands

MAIN_JOB = main_job()
CPU_CONFIGS, GPU_CONFIGS, default_configs = MAIN_JOB.CPU_CONFIGS, MAIN_JOB.GPU_CONFIGS, MAIN_JOB.default_configs

ALL = sorted(CONFIGS.rglob("*.yaml"))
BASE = CONFIGS / "regression" / "single_device.yaml"
DDP = "configs/trainer/ddp.yaml"
FSDP = "configs/trainer/fsdp.yaml"
TP = "configs/trainer/tp.yaml"
PP = "configs/trainer/pp.yaml"
# What slurm/train.sbatch composes before the config it is given (asserted in test_sbatch_composes_fragments).
SBATCH_FRAGMENTS = [DDP, "configs/trainer/slurm.yaml"]
COLLECTIVE_TIMEOUT = timedelta(minutes=5)


def is_complete(path: Path) -> bool:
    doc = yaml.safe_load(path.read_text()) or {}
    return "model" in doc and "data" in doc


def resolved(configs: list[str], capsys: pytest.CaptureFixture, *extra: str) -> dict:
    """The config ``lit-ddp fit --config A --config B ... EXTRA`` resolves to (``--print_config``)."""
    args = [a for c in configs for a in ("--config", str(REPO / c))]
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", *args, *extra, "--print_config"])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err[-2000:]
    return yaml.safe_load(out.out)


def readme_compositions() -> dict[str, list[str]]:
    """Every ``lit-ddp fit`` / ``-m lit_ddp fit`` / ``sbatch slurm/train.sbatch`` / ``make train`` command of
    the README and docs/tutorial.md, as the list of configs it composes, keyed by the command."""
    found: dict[str, list[str]] = {}
    for command in documented_commands():
        words = shlex.split(command)
        if "fit" in words and "--config" in words:
            found[command] = [words[i + 1] for i, w in enumerate(words) if w == "--config"]
        elif "slurm/train.sbatch" in words[:-1] and words[0] == "sbatch":
            after = words[words.index("slurm/train.sbatch") + 1 :]  # CONFIG, then overrides such as --config F
            overrides = [after[i + 1] for i, w in enumerate(after) if w == "--config"]
            found[command] = [*SBATCH_FRAGMENTS, after[0], *overrides]
        elif words[:2] == ["make", "train"] and len(words) == 2:  # the Makefile's choice on this machine
            found[command] = list(default_configs())
    return found


@pytest.mark.parametrize("path", [p for p in ALL if is_complete(p)], ids=lambda p: str(p.relative_to(CONFIGS)))
def test_complete_config_parses(path: Path, capsys: pytest.CaptureFixture) -> None:
    printed = resolved([str(path.relative_to(REPO))], capsys)
    assert printed["model"]["class_path"].startswith("lit_ddp.tasks.")
    assert printed["data"]["class_path"].startswith("lit_ddp.data.")
    assert printed["trainer"]["default_root_dir"].startswith("runs/")


FRAGMENTS = [p for p in ALL if not is_complete(p) and p.parent.name in ("trainer", "checkpoint")]


@pytest.mark.parametrize("path", FRAGMENTS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_fragment_composes(path: Path, capsys: pytest.CaptureFixture) -> None:
    printed = resolved([str(BASE.relative_to(REPO)), str(path.relative_to(REPO))], capsys)
    fragment = yaml.safe_load(path.read_text())
    for section, values in fragment.items():
        for key, value in values.items():
            if not isinstance(value, dict | list):
                assert printed[section][key] == value, f"{path}: {section}.{key}"


LAUNCHED_ELSEWHERE = {"configs/trainer/torchft.yaml": "docs/torchft.md"}
"""Fragments that are no tutorial step: started by their own launcher (``python -m lit_ddp.ft.launch``), shown there."""


def test_readme_lists_every_step() -> None:
    """Each tutorial step is one README command; together they use every shipped config (so the step
    configs that are not complete alone are parsed there, composed as documented)."""
    compositions = readme_compositions()
    used = {c for configs in compositions.values() for c in configs}
    shipped = {str(p.relative_to(REPO)) for p in ALL}
    for config, page in LAUNCHED_ELSEWHERE.items():  # their own launcher, on their own page
        assert f"--config {config}" in (REPO / page).read_text(), f"{page} shows no command with {config}"
    assert shipped - used - set(LAUNCHED_ELSEWHERE) == set(), "configs no README command uses"
    assert used - shipped == set(), "README commands name configs that do not exist"


def backend_on(strategy: dict, device: str) -> str:
    """The process-group backend the config's strategy (DDP, FSDP2 or the pipeline's) would use on ``device``."""
    init_args = {k: v for k, v in strategy.get("init_args", {}).items() if k in ("process_group_backend", "timeout")}
    module, _, name = strategy["class_path"].rpartition(".")
    instance = getattr(importlib.import_module(module), name)(**init_args)
    instance.parallel_devices = [torch.device(device, 0), torch.device(device, 1)]
    return instance._get_process_group_backend()


@pytest.mark.parametrize("command", list(readme_compositions()), ids=lambda c: c.split()[-1])
def test_readme_command_backend_and_timeout(command: str, capsys: pytest.CaptureFixture) -> None:
    """No composition forces a backend (gloo on CPU, NCCL on CUDA); a multi-process one has a 5-minute
    collective timeout; the same composition with the GPU fragment last keeps both."""
    configs = readme_compositions()[command]
    printed = resolved(configs, capsys)
    trainer = printed["trainer"]
    processes_per_node = trainer["devices"] if isinstance(trainer["devices"], int) else 1
    multi = processes_per_node * int(trainer.get("num_nodes") or 1) != 1  # -1: all GPUs
    if not multi and trainer["accelerator"] != "gpu":
        assert trainer["strategy"] in ("auto", None), command
        return
    strategy = trainer["strategy"]
    assert isinstance(strategy, dict), command
    assert strategy["class_path"].endswith(("DDPStrategy", "FSDP2Strategy", "PipelineStrategy")), command
    assert strategy["init_args"]["process_group_backend"] is None, "no config may force a backend"
    assert backend_on(strategy, "cpu") == "gloo"
    assert backend_on(strategy, "cuda") == "nccl"
    assert strategy["init_args"]["timeout"] in ("0:05:00", str(COLLECTIVE_TIMEOUT)), command
    if "configs/trainer/gpu.yaml" not in configs:
        on_gpu = resolved([*configs, "configs/trainer/gpu.yaml"], capsys)
        assert on_gpu["trainer"]["accelerator"] == "gpu"
        assert on_gpu["trainer"]["strategy"] == strategy, "the GPU fragment changes only the accelerator"


def test_multiprocess_configs_need_the_ddp_fragment(capsys: pytest.CaptureFixture) -> None:
    """Every step config that starts several processes is composed with the DDP (or FSDP2, TP or PP) fragment first in
    the README."""
    for command, configs in readme_compositions().items():
        trainer = resolved(configs, capsys)["trainer"]
        if int(trainer.get("devices") or 1) * int(trainer.get("num_nodes") or 1) > 1:
            assert configs[0] in (DDP, FSDP, TP, PP), command


def leaves(node: object) -> int:
    """Number of scalar values in ``node``."""
    if isinstance(node, dict):
        return sum(leaves(v) for v in node.values())
    if isinstance(node, list):
        return sum(leaves(v) for v in node)
    return 1


def subtrees(node: object, path: str = "") -> list[tuple[str, object]]:
    """(path, subtree) of every mapping and list in ``node``, itself included."""
    if not isinstance(node, dict | list):
        return []
    items = node.items() if isinstance(node, dict) else enumerate(node)
    return [(path, node), *(t for k, v in items for t in subtrees(v, f"{path}.{k}"))]


def test_no_block_is_repeated() -> None:
    """A configured object (``class_path`` with arguments) or any block of three or more values lives in one
    YAML file only: shared pieces are fragments that the commands compose."""
    seen: dict[str, str] = {}
    for path in ALL:
        for where, node in subtrees(yaml.safe_load(path.read_text()) or {}):
            n = leaves(node)
            if n >= 3 or (isinstance(node, dict) and "class_path" in node and n >= 2):
                canonical = json.dumps(node, sort_keys=True, default=str)
                here = f"{path.relative_to(CONFIGS)}:{where}"
                assert canonical not in seen, f"{here} repeats {seen[canonical]}"
                seen[canonical] = here


def test_sbatch_composes_fragments() -> None:
    script = (REPO / "slurm" / "train.sbatch").read_text()
    for fragment in SBATCH_FRAGMENTS:
        assert fragment in script


@pytest.mark.parametrize("name", ["cpu", "tutorial"])  # the others compose cpu.yaml
def test_step_configs_sample_and_measure_throughput(name: str) -> None:
    """Text samples and throughput/MFU are trainer callbacks of every complete minGPT step config, not model
    hyperparameters: what TensorBoard shows (``samples``, ``train/device/items_per_sec``...) stays."""
    config = yaml.safe_load((CONFIGS / "mingpt" / f"{name}.yaml").read_text())
    paths = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert paths[-1] == "lit_ddp.callbacks.text_samples.TextSampleCallback"  # last: --trainer.callbacks.init_args
    assert any(p.endswith(".TokenThroughputMonitor") for p in paths)
    assert not {"sample_tokens", "sample_prompt", "available_flops"} & set(config["model"].get("init_args") or {})


def test_the_tutorial_page_gives_figures_for_every_step_runnable_here() -> None:
    """docs/tutorial.md's "What each step prints" has a row for each README step and each of its other compositions
    (the GPU ones' figures come from a GPU machine), and no other."""
    _, figures = page_figures()
    runnable = {name for name, command in step_commands().items() if "gpu.yaml" not in command}
    assert runnable - set(figures) == set(), "documented commands the page gives no figures for"
    assert set(figures) - set(step_commands()) == set(), "page rows that name no documented command"


@pytest.mark.parametrize("command", list(readme_compositions()), ids=lambda c: c.split()[-1])
def test_readme_command_builds_its_ddp_without_warnings(
    command: str, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """The DDP strategy of every README composition wraps a module with buffers on this torch without a warning or
    a rejected option (torch 2.13 renamed ``broadcast_buffers``: lit_ddp.strategies.DDPStrategy picks the name), and
    with no per-step buffer broadcast. ``make test-torch`` runs it on the floor of the torch range and on the newest."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    strategy = resolved(readme_compositions()[command], capsys)["trainer"]["strategy"]
    if not (isinstance(strategy, dict) and strategy["class_path"].endswith(".DDPStrategy")):
        pytest.skip(f"{command}: no DDP strategy")
    module, _, name = strategy["class_path"].rpartition(".")
    init_args = {k: v for k, v in strategy["init_args"].items() if k not in ("timeout",)}
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            instance = getattr(importlib.import_module(module), name)(**init_args)
            net = torch.nn.BatchNorm1d(3)  # a module with buffers
            ddp = DistributedDataParallel(net, **instance._ddp_kwargs)
        assert ddp.require_forward_param_sync is True and not getattr(
            ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)
        ), f"{command}: DDP broadcasts buffers every step"
    finally:
        dist.destroy_process_group()


def make_train_command(python: Path) -> list[str]:
    """The ``lit-ddp fit`` command ``make -n train`` prints when the Makefile asks ``python`` which configs to compose
    (``BIN`` is ``python``'s folder), split into words."""
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIGS", "MAKEFLAGS", "MFLAGS")}
    result = subprocess.run(
        ["make", "-n", "train", f"BIN={python.parent}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if " fit " in line]
    return shlex.split(line)


def composed(words: list[str]) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words) if w == "--config"]


def test_make_train_chooses_the_cpu_config_here() -> None:
    """``make train`` composes the CPU main job where torch sees no CUDA device (this machine, this interpreter), as
    ``scripts/main_job.py`` says; the README's ``make train`` commands are checked as that composition."""
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    assert default_configs() == CPU_CONFIGS
    assert composed(make_train_command(Path(sys.executable))) == list(CPU_CONFIGS)


def test_make_train_chooses_the_gpu_config_where_cuda_is_reported(tmp_path: Path) -> None:
    """Where torch reports a CUDA device, ``make train`` composes ``configs/mingpt/gpu.yaml``: the Makefile asks a
    ``python`` that is this interpreter with ``torch.cuda.is_available`` answering True."""
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    report_cuda = "import runpy, sys, torch; torch.cuda.is_available = lambda: True; del sys.argv[:1]; "
    report_cuda += "runpy.run_path(sys.argv[0], run_name='__main__')"
    # the Makefile runs `python scripts/main_job.py`: argv[1:] is ['scripts/main_job.py']
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(report_cuda)} "$@"\n')
    python.chmod(0o755)
    assert composed(make_train_command(python)) == list(GPU_CONFIGS)


def test_default_configs_follow_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Makefile asks (``python scripts/main_job.py``): the GPU main job where torch reports a CUDA
    device, the CPU one otherwise; both exist."""
    for available, expected in ((True, GPU_CONFIGS), (False, CPU_CONFIGS)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert default_configs() == expected
    assert all((REPO / path).is_file() for path in (*CPU_CONFIGS, *GPU_CONFIGS))


# The GPU main job on this CPU: the same config, on one CPU process, without compiling, a tiny model for 5 steps.
GPU_JOB_ON_CPU = [
    "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "5",
    "--trainer.val_check_interval", "5", "--trainer.enable_progress_bar", "false",
    "--model.init_args.compile", "false",
    "--model.init_args.n_layer", "1", "--model.init_args.n_head", "2", "--model.init_args.n_embd", "32",
    "--data.init_args.block_size", "32", "--data.init_args.batch_size", "8", "--data.init_args.truncate", "0.02",
]  # fmt: skip


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gpu_main_job_dry_run_on_cpu(
    precision: str, tmp_path: Path, capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture
) -> None:
    """``configs/mingpt/gpu.yaml`` trains here with the overrides of a CPU (its comment gives the command), in float32
    and in the bf16 autocast it runs in on GPUs: Muon + AdamW, the schedule, validation, the model summary without
    a warning, one checkpoint (last.ckpt, at the end), and no line of the noise list."""
    configs = ["--config", str(REPO / DDP), "--config", str(CONFIGS / "mingpt" / "gpu.yaml")]
    root = ["--trainer.default_root_dir", str(tmp_path)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = cli_main(["fit", *configs, *GPU_JOB_ON_CPU, "--trainer.precision", precision, *root])
    assert cli is not None and cli.trainer.global_step == 5
    assert cli.trainer.precision == precision
    assert float(cli.trainer.callback_metrics["val/loss"]) < 4.5  # ln(65) = 4.17 at the start
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt"]
    assert "Total params" in caplog.text, "the model summary"
    output = "\n".join([capsys.readouterr().out, caplog.text, *(str(w.message) for w in caught)])
    assert noise_lines(output) == []
