"""bench.gpu_step_profile on the CPU with a tiny model: every part of the step is timed and the plain step's tokens/s
follows from its milliseconds (the GPU figures come from running it on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu_step_profile import main


def test_step_parts_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    argv = ["--device", "cpu", "--tiny", "--no-compile", "--batch_size", "2", "3", "--warmup", "1", "--iters", "2"]
    assert main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [r["batch_size"] for r in results] == [2, 3]
    for r in results:
        assert set(r["ms"]) == {"fwd+bwd", "clip", "muon+adamw", "adamw", "step"}  # no compiled step: --no-compile
        assert all(ms > 0 for ms in r["ms"].values())
        assert r["tokens_per_step"] == r["batch_size"] * 32
        assert r["tokens_per_s"] == r["tokens_per_step"] / (r["ms"]["step"] / 1e3)
        assert "--no-compile" in r["compile_optimizer_error"]
