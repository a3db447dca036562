# Every target a README command names. `make train` and `make test` set up .venv themselves.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned and installed first: an unpinned torch pulls several GB of CUDA wheels.
TORCH_VERSION ?= 2.13.0
# `make train` composes these configs in order (DDP fragment, then the step config).
CONFIGS ?= configs/trainer/ddp.yaml configs/mingpt/cpu.yaml
PYTEST_ARGS ?=

.PHONY: venv train test test-fast lint format bench bench-speed bench-recovery bench-save bench-fsdp bench-gpu clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "torch==$(TORCH_VERSION)"
	$(BIN)/python -m pip install -e ".[dev]"
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

# Only the unit tests (tests/unit: none carries a slow / multiprocess / slurm marker; tests/conftest.py checks).
test-fast: venv
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# What checkpointing costs per step (synchronous vs asynchronous saves).
bench: venv
	$(BIN)/python -m bench.checkpoint_overhead $(BENCH_ARGS)

# The main job's speed table: time to val/loss 1.886 vs nanoGPT's CPU recipe, Lightning vs plain DDP step
# time, DDP scaling, MFU (about 20 minutes; README "Speed").
bench-speed: venv
	$(BIN)/python -m bench.speed $(BENCH_ARGS)

# Seconds from a killed or hung worker to the first optimizer step after torchrun's restart (about 2 minutes).
bench-recovery: venv
	$(BIN)/python -m bench.recovery $(BENCH_ARGS)

# FSDP2 against DDP: bytes per rank (tutorial-size GPT, 1 and 2 processes) and step time side by side (~10 min).
bench-fsdp: venv
	$(BIN)/python -m bench.fsdp $(BENCH_ARGS)

# The GPU path (GPU machines only, 8 to 10 minutes on one H100): the tutorial's minGPT in bf16 over NCCL under DDP
# and FSDP2, each killed twice by lit-ddp chaos and compared bit for bit with an uninterrupted run; tokens/s, MFU.
bench-gpu: venv
	PYTHON=$(BIN)/python bash bench/gpu_path.sh

bench-save: venv
	$(BIN)/python -m bench.atomic_save $(BENCH_ARGS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
