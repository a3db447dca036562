"""docs/your_model.md's example (``examples/your_model.py``, ``examples/your_model.yaml``): a model of one's own,
named by ``class_path``, trains under lit-ddp, and a run killed mid-epoch ends bit for bit where an uninterrupted
one does (``lit-ddp chaos``, as the page tells its readers to check); with a plain ``DataLoader`` in place of the
stateful one the page asks for, the same check fails, as the page says it would."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from examples.your_model import BlobsDataModule
from tests.helpers import REPO, Runner, lit_ddp

PAGE = REPO / "docs" / "your_model.md"
# The page's command, after `--` (chaos's fit arguments), two epochs of 56 steps: a checkpoint every 50.
FIT = ["--config", "configs/trainer/ddp.yaml", "--config", "configs/checkpoint/fault_tolerant.yaml",
       "--config", "examples/your_model.yaml"]  # fmt: skip


class PlainLoaderBlobs(BlobsDataModule):
    """The example's data through a plain ``DataLoader`` (Lightning gives it a ``DistributedSampler``): what the
    page says a model of one's own must not do."""

    def train_dataloader(self) -> DataLoader:  # type: ignore[override]
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)


def chaos(runner: Runner, root: Path, *extra: str) -> tuple[int, str]:
    cmd = lit_ddp("chaos", "--launcher", "torchrun", "--nproc_per_node", "2", "--faults", "1", "--kinds", "kill",
                  "--seed", "3", "--root", str(root), "--", *FIT, *extra)  # fmt: skip
    result = runner.run(cmd, timeout=420, cwd=REPO)
    return result.returncode, result.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_your_model_resumes_exactly_after_a_kill(tmp_path: Path, runner: Runner) -> None:
    """The page's chaos command: an uninterrupted run of the example and one whose worker is SIGKILLed after a
    step checkpoint, restarted by torchrun: identical. The uninterrupted run prints the page's last validation."""
    code, out = chaos(runner, tmp_path)
    assert code == 0 and "identical: the faulted run ends bit for bit" in out, out[-4000:]
    reference = (tmp_path / "reference.log").read_text()
    [documented] = re.findall(r"^last validation: .*$", PAGE.read_text(), re.M)
    [printed] = re.findall(r"^last validation: .*$", reference, re.M)
    pairs = list(zip(re.findall(r"\d\.\d+", documented), re.findall(r"\d\.\d+", printed), strict=True))
    assert pairs and all(math.isclose(float(a), float(b), rel_tol=0.01, abs_tol=1e-3) for a, b in pairs), printed


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_a_plain_dataloader_does_not_resume_exactly(tmp_path: Path, runner: Runner) -> None:
    """The same check with the train loader a plain ``DataLoader``: the run resumed mid-epoch draws other batches
    than the uninterrupted one, and chaos says so (exit 1, the first entry that differs)."""
    code, out = chaos(runner, tmp_path, "--data.class_path", "tests.system.test_your_model.PlainLoaderBlobs")
    assert code == 1 and "DIFFERENT" in out, out[-4000:]
