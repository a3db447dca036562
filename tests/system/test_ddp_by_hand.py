"""The plain-PyTorch DDP workers behind ``notebooks/00_what_is_ddp.ipynb`` finish and exit, every time.

Before the DDP wrapper was dropped ahead of ``destroy_process_group``, about one spawn in two never exited
(a GIL deadlock in the gloo backend's destructor), so the notebook test failed now and then; a few spawns
in a row catch that with high probability.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_ddp import ddp_by_hand

REPEATS = 4


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(REPEATS * 60 + 30)
def test_grad_workers_exit_every_time(tmp_path: Path) -> None:
    reference = ddp_by_hand.reference_grads(16)
    for i in range(REPEATS):
        out = tmp_path / str(i)
        out.mkdir()
        ddp_by_hand.spawn(ddp_by_hand.grad_worker, str(out), 16, 0.1, world_size=2, timeout=60)
        ranks = ddp_by_hand.load_results(out, 2)
        assert [r["rows"] for r in ranks] == [list(range(0, 16, 2)), list(range(1, 16, 2))]
        for record in ranks:
            assert ddp_by_hand.max_abs_diff(record["grads"], reference) < 1e-6
        assert ddp_by_hand.max_abs_diff(ranks[0]["params_after_step"], ranks[1]["params_after_step"]) == 0.0
