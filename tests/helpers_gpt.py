"""Test helpers for the minGPT task: a per-rank metrics recorder and tiny-run command lines."""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]
SHARED_TEXT = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
CPU_CONFIG = REPO / "configs" / "mingpt" / "cpu.yaml"

# A tiny GPT and a small slice of text: seconds per run on 2 cores.
TINY_ARGS = [
    "--model.init_args.n_layer", "1",
    "--model.init_args.n_head", "2",
    "--model.init_args.n_embd", "16",
    "--model.init_args.sample_tokens", "20",
    "--data.init_args.block_size", "16",
    "--data.init_args.batch_size", "8",
    "--data.init_args.truncate", "0.02",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip


class RecordMetrics(Callback):
    """Writes ``<out_dir>/rank<R>.json`` after every validation (not the sanity check): the global step and
    the trainer's ``callback_metrics`` as floats, as this rank sees them.

    Args:
        out_dir: where to write; created if missing.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        record = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        Path(self.out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
