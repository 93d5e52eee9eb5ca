"""The comparison's figure: KL and perplexity against step, one line per layout."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from models.io.atomic import atomic_write_bytes


def plot_curves(summary: dict[str, Any], path: Path) -> Path:
    """KL and perplexity against step, one line per layout (seed mean bold, seeds faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (name, c) in enumerate(summary["layouts"].items()):
        color = f"C{i}"
        for metric, ax in zip(("kl", "ppl"), axes, strict=True):
            ax.plot(c["steps"], c[metric], color=color, lw=2, label=name, marker="o", ms=3)
            if len(c["seeds"]) > 1:
                for seed_curve in c["seeds"].values():
                    ax.plot(c["steps"], seed_curve[metric], color=color, lw=0.8, alpha=0.35)
    axes[1].axhline(summary["dense_ppl"], color="k", ls="--", lw=1, label="dense")
    axes[0].set_ylabel("KL to the dense model (nats/token)")
    axes[1].set_ylabel("perplexity")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{summary['model']}: L={summary['devices']}, δ={summary['delta']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path
