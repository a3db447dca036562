#!/usr/bin/env bash
# The package on another torch: `make test-torch TORCH=2.15.0` (or `bash scripts/test_torch.sh 2.15.0`).
# Builds .venv-torch-X with torch X from the package index, installs the project beside it without letting pip
# change that torch, then runs the unit tests and the system tests nearest torch's distributed internals.
# Not part of `make test`: CI keeps the torch of `make venv` (TORCH_VERSION in the Makefile).
set -euo pipefail

torch_version=${1:?usage: scripts/test_torch.sh TORCH_VERSION (e.g. 2.15.0)}
python=${PYTHON:-python3}
workers=${TEST_WORKERS:-2}
cd "$(dirname "$0")/.."
venv=.venv-torch-$torch_version
start=$SECONDS
trap 'echo "test-torch $torch_version: $((SECONDS - start)) s in all"' EXIT

# One constraint file for every pip call: it holds torch at X through the project's install (which would
# otherwise take any torch in pyproject's range), and PIP_CONSTRAINT replaces the constraint file a machine's
# pip configuration may name (one capping torch below X).
test -x "$venv/bin/python" || "$python" -m venv "$venv"
echo "torch==$torch_version" >"$venv/constraints.txt"
export PIP_CONSTRAINT=$PWD/$venv/constraints.txt
"$venv/bin/python" -m pip install --quiet "torch==$torch_version"
"$venv/bin/python" -m pip install --quiet -e ".[dev]"

installed=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
if [[ ${installed%%+*} != "$torch_version" ]]; then  # a local tag (+cpu, +cu130) is the same release
    echo "test-torch: $venv has torch $installed after the install, not $torch_version" >&2
    exit 1
fi
echo "test-torch: torch $installed, unchanged by the project's install"

system_tests=(
    tests/system/test_regression_cli.py::test_torchrun_standalone  # DDP under torchrun
    tests/system/test_fsdp.py::test_fsdp2_trains_what_ddp_trains
    tests/system/test_fsdp.py::test_a_sharded_checkpoint_resumes_on_another_number_of_processes
    tests/system/test_fsdp.py::test_tensor_parallel_splits_q_k_v_by_heads_and_computes_the_same  # _StridedShard
    tests/system/test_chaos.py::test_chaos_under_torchrun_finds_the_run_exact  # kills, hangs, SIGTERM
    tests/system/test_reliability.py::test_torch_shared_store_still_breaks_restarts  # pytorch#135712
)
status=0
"$venv/bin/python" -m pytest tests/unit -n "$workers" -m "not serial" -q || status=$?
# the tests that time how fast something ends, alone, as `make test` runs them
"$venv/bin/python" -m pytest tests/unit -m serial -q || status=$?
"$venv/bin/python" -m pytest "${system_tests[@]}" -n "$workers" -q -rA --durations=0 || status=$?
exit "$status"
