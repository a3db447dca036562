# Every target a README command names. `make train` and `make test` set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned (what CI tests) and installed first; which build, pip's index decides (from PyPI on Linux, the CUDA
# one: several GB). A torch of this version already in the venv is kept (README "Install": the CPU build on purpose).
TORCH_VERSION ?= 2.13.0
# `make train` composes these configs in order (DDP fragment, then the step config): configs/mingpt/gpu.yaml where
# torch sees a CUDA device, configs/mingpt/cpu.yaml otherwise: the venv's torch is asked (scripts/main_job.py)
# when the recipe runs, after `venv` (`?=` expands a variable where it is used, not here).
CONFIGS ?= $(shell $(BIN)/python scripts/main_job.py)
PYTEST_ARGS ?=

.PHONY: venv train test test-fast lint format bench bench-startup bench-speed bench-recovery bench-fsdp bench-pipeline bench-gpu bench-launches bench-syncs bench-integrity clean \
	step1 step2 step3 step4 step5 notebooks

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -e ".[dev,torchft]"
	touch $@

venv: $(BIN)/.installed

train: venv
	$(if $(DATA),LIT_DDP_DATA="$(DATA)") $(BIN)/lit-ddp fit $(foreach c,$(CONFIGS),--config $(c)) $(ARGS)

lint: venv
	$(BIN)/ruff check lit_ddp tests bench scripts
	$(BIN)/ruff format --check lit_ddp tests bench scripts
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format lit_ddp tests bench scripts
	$(BIN)/ruff check --fix lit_ddp tests bench scripts

# The whole suite: lint, then every test on TEST_WORKERS pytest-xdist workers (the suite waits on subprocesses
# and Slurm a third of its time; the Slurm tests run in order on one worker, as they share the local cluster,
# and skip unless it runs: `slurm/local_cluster.sh start`), then the `serial` ones, which time how fast
# something ends, alone (status 5: none selected). The 25 slowest tests are listed: the suite's time is a
# budget (docs/development.md).
TEST_WORKERS ?= 2
test: venv lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup -m "not serial" --durations=25 $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m serial $(PYTEST_ARGS) || test $$? -eq 5

# The README's five steps, each the command its section shows (tests/unit/test_readme.py checks that they agree).
# step4 starts the multinode step's two agents on this machine, the first node at 127.0.0.1.
step1: venv
	$(BIN)/lit-ddp fit --config configs/regression/single_device.yaml

step2: venv
	$(BIN)/lit-ddp fit --config configs/trainer/ddp.yaml --config configs/regression/ddp.yaml

step3: venv
	TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 $(BIN)/torchrun --standalone --nproc_per_node 2 \
	  --max-restarts 3 -m lit_ddp fit --config configs/trainer/ddp.yaml \
	  --config configs/checkpoint/fault_tolerant.yaml --config configs/regression/fault_tolerant.yaml

STEP4 = $(BIN)/torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_id job1 \
	  --rdzv_endpoint $${HEAD_HOST:-127.0.0.1}:29500 -m lit_ddp fit \
	  --config configs/trainer/ddp.yaml --config configs/regression/multinode.yaml
step4: venv
	$(STEP4) & $(STEP4); wait

step5: venv
	$(BIN)/lit-ddp fit --config configs/trainer/ddp.yaml --config configs/mingpt/cpu.yaml

# Every notebook run top to bottom and saved with its outputs, figures inline (about 4 minutes on 2 cores; their runs
# go to runs/notebooks).
notebooks: venv
	for nb in notebooks/*.ipynb; do \
	  MPLBACKEND=module://matplotlib_inline.backend_inline $(BIN)/jupyter nbconvert --to notebook --execute \
	    --inplace --ExecutePreprocessor.timeout=600 --ExecutePreprocessor.record_timing=False "$$nb" || exit 1; \
	done

# Only the unit tests (tests/unit: none carries a slow / multiprocess / slurm marker; tests/conftest.py checks).
test-fast: venv
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# The unit tests and a few system tests (torchrun, FSDP2, chaos, torch's shared store) on another torch, in a side
# venv .venv-torch-X: `make test-torch TORCH=2.15.0` (8 minutes from scratch, 6 with the venv built). Not part of
# `make test`, which runs TORCH_VERSION.
.PHONY: test-torch
test-torch:
	$(if $(TORCH),,$(error say which torch: make test-torch TORCH=2.15.0))
	PYTHON=$(PYTHON) TEST_WORKERS=$(TEST_WORKERS) bash scripts/test_torch.sh $(TORCH)

# Start-up part by part, lit-ddp fit against a bare Lightning Trainer.fit of the same module (a minute or two;
# BENCH_ARGS="--devices 2 --configs configs/trainer/ddp.yaml configs/mingpt/cpu.yaml": make train's job).
bench-startup: venv
	$(BIN)/python -m bench.startup $(BENCH_ARGS)

# What checkpointing costs per step (synchronous vs asynchronous saves).
bench: venv
	$(BIN)/python -m bench.checkpoint_overhead $(BENCH_ARGS)

# The main job's speed table: time to val/loss 1.886 vs nanoGPT's CPU recipe, Lightning vs plain DDP step
# time, DDP scaling, MFU (about 20 minutes; docs/speed.md, "The speed table").
bench-speed: venv
	$(BIN)/python -m bench.speed $(BENCH_ARGS)

# Seconds from a killed or hung worker to the first optimizer step after torchrun's restart (about 2 minutes).
bench-recovery: venv
	$(BIN)/python -m bench.recovery $(BENCH_ARGS)

# The GPU main job's kernel launches counted on this CPU: aten ops and ms per optimizer step and per training step of
# gpu.yaml's model, torch's Muon against BatchedMuon (about a minute).
bench-launches: venv
	$(BIN)/python -m bench.launches $(BENCH_ARGS)

# The GPU main job's host-device syncs per training step, counted on this CPU (a tiny gpu.yaml fit; about a minute).
bench-syncs: venv
	$(BIN)/python -m bench.host_syncs $(BENCH_ARGS)

# What verifying checkpoints and replicas costs: saves and resumes with and without digests, the replica check per
# step (make train's model and the tutorial's GPT; docs/fault_tolerance.md, "What is verified").
bench-integrity: venv
	$(BIN)/python -m bench.integrity $(BENCH_ARGS)

# FSDP2 against DDP: the bytes each rank holds after a step (tutorial-size GPT, 1 and 2 processes; about a minute).
bench-fsdp: venv
	$(BIN)/python -m bench.fsdp $(BENCH_ARGS)

# Pipeline parallelism: steps/s and peak memory per rank of 1 and 2 stages, each schedule, 1-8 microbatches, in turns
# (docs/tutorial.md, "Pipeline parallelism"; about 15 minutes here).
bench-pipeline: venv
	$(BIN)/python -m bench.pipeline $(BENCH_ARGS)

# The GPU check (GPU machines; bench/gpu_check.py) in two halves of at most 7 minutes each, every part alone and
# time-boxed, one table each (also under $OUT, else runs/bench_gpu). bench-gpu-speed: the GPU main job against
# nanoGPT's GPU recipe, the tutorial config's tokens/s and MFU, restart seconds. bench-gpu-path: three fits at once
# ending promptly, lit-ddp chaos under FSDP2 and DDP, generate on the GPU, the deterministic kernels' cost. bench-gpu:
# both in one run (about 13 minutes: on a device machine, call the halves one after the other). With PYTHON given
# (`make bench-gpu-speed PYTHON=python3`, a GPU image): that Python and no venv; the wheels in .whl/ are installed
# into /tmp/site where it lacks them. BENCH_GPU_PARTS="..." runs some parts; BENCH_GPU_DRY=1 runs them on the CPU with
# tiny sizes (the plumbing, a few minutes).
BENCH_GPU_PYTHON = $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(BIN)/python)
BENCH_GPU_DEPS = $(if $(filter command line environment,$(origin PYTHON)),,venv)
.PHONY: bench-gpu-speed bench-gpu-path
bench-gpu: $(BENCH_GPU_DEPS)
	$(BENCH_GPU_PYTHON) -m bench.gpu_check

bench-gpu-speed: $(BENCH_GPU_DEPS)
	BENCH_GPU_PARTS=speed $(BENCH_GPU_PYTHON) -m bench.gpu_check

bench-gpu-path: $(BENCH_GPU_DEPS)
	BENCH_GPU_PARTS=path $(BENCH_GPU_PYTHON) -m bench.gpu_check

clean:
	rm -rf runs .pytest_cache .ruff_cache
