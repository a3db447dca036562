"""Plots the train and validation loss of real runs, read from their TensorBoard event files.

    python scripts/plot_loss_curves.py runs/mingpt/cpu_1000 --out docs/loss_curves.png

Each RUN_DIR is a ``trainer.default_root_dir`` (event files directly in it). The training curve is
``train/loss`` (minGPT) or ``train/loss_step`` (regression), the validation curve ``val/loss``; the x axis is
the optimizer step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable without installing the package
from lit_ddp.tensorboard import read_scalars, scalar_tags  # noqa: E402

TRAIN_TAGS = ("train/loss", "train/loss_step")


def plot(run_dirs: list[Path], out: Path, labels: list[str] | None = None, title: str | None = None) -> Path:
    """Writes the loss curves of ``run_dirs`` to ``out`` (format from its suffix) and returns ``out``.

    Raises:
        ValueError: a run directory has no ``val/loss`` or no training loss, or ``labels`` has the wrong length.
    """
    labels = labels or [p.name for p in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} run directories")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for i, (run, label) in enumerate(zip(run_dirs, labels, strict=True)):
        tags = scalar_tags(run)
        train_tag = next((t for t in TRAIN_TAGS if t in tags), None)
        if train_tag is None or "val/loss" not in tags:
            raise ValueError(f"{run}: needs val/loss and one of {TRAIN_TAGS}; logged: {tags}")
        color = f"C{i}"
        train = read_scalars(run, train_tag)
        val = read_scalars(run, "val/loss")
        prefix = f"{label}: " if len(run_dirs) > 1 else ""
        ax.plot([s + 1 for s, _ in train], [v for _, v in train], color=color, alpha=0.45, lw=1, label=f"{prefix}train")
        ax.plot([s + 1 for s, _ in val], [v for _, v in val], "o-", color=color, ms=4, label=f"{prefix}validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(title or ", ".join(labels), fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="trainer.default_root_dir of a run")
    parser.add_argument("--out", type=Path, default=Path("docs/loss_curves.png"), help="image file to write")
    parser.add_argument("--labels", nargs="+", help="one legend label per RUN_DIR (default: directory names)")
    parser.add_argument("--title", help="plot title (default: the labels)")
    args = parser.parse_args(argv)
    try:
        out = plot(args.run_dirs, args.out, args.labels, args.title)
    except (KeyError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
