"""Does the co-located score at initialisation predict the trained KL? (§5.2 of the paper.)

From a layout study's optimise report (each layout's J in FO and ADD units) and its distillation metrics
(KL per layout and evaluation step): Pearson and Spearman correlations of J against the KL at a step
(the last one by default, and step 0, the untrained KL), a scatter plot, and a markdown section.
The paper finds Pearson −0.81 / −0.89 over 17 layouts after 1000 steps.

Reads whatever runs have reached the step, so a partial study still gives numbers (with its n).

    .venv/bin/python bench/score_kl.py --work var/study-spread    # prints the section
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from models.affinity.names import SCORES

REPO = Path(__file__).resolve().parent.parent


def kl_by_layout(metrics_csv: Path) -> dict[str, dict[int, float]]:
    """layout -> step -> KL, averaged over seeds, from a comparison's metrics.csv."""
    sums: dict[str, dict[int, list[float]]] = {}
    if not metrics_csv.exists():
        return {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            sums.setdefault(row["layout"], {}).setdefault(int(row["step"]), []).append(float(row["kl"]))
    return {name: {step: sum(v) / len(v) for step, v in steps.items()} for name, steps in sums.items()}


def layout_scores(report: dict[str, Any], units: str) -> dict[str, float]:
    """layout -> J in `units` (fo|add); older reports without per-unit scores give their own J."""
    out = {}
    for name, rep in report["layouts"].items():
        scores = rep.get("scores") or {}
        out[name] = float(scores[units]["J"]) if units in scores else float(rep["J"])
    return out


def correlation(xs: list[float], ys: list[float]) -> dict[str, Any]:
    from scipy import stats

    n = len(xs)
    if n < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return {"n": n, "pearson": None, "pearson_p": None, "spearman": None, "spearman_p": None}
    pearson = stats.pearsonr(xs, ys)
    spearman = stats.spearmanr(xs, ys)
    return {"n": n, "pearson": float(pearson.statistic), "pearson_p": float(pearson.pvalue),
            "spearman": float(spearman.statistic), "spearman_p": float(spearman.pvalue)}


def analyse(report: dict[str, Any], kl: dict[str, dict[int, float]], *, step: int | None = None,
            units: str = "fo") -> dict[str, Any]:
    """Score-vs-KL correlations at `step` (default: the last step every finished run reached) and at step 0."""
    scores = layout_scores(report, units)
    names = [n for n in scores if n in kl]
    if step is None:
        finals = [max(kl[n]) for n in names]
        step = max(finals) if finals else 0
    points: list[dict[str, Any]] = [{"layout": n, "J": scores[n], "kl": kl[n].get(step), "kl0": kl[n].get(0),
                                     "random": n.startswith("random-")} for n in names]
    trained = [p for p in points if p["kl"] is not None]
    untrained = [p for p in points if p["kl0"] is not None]
    non_random = [p for p in trained if not p["random"]]
    return {
        "units": units,
        "step": step,
        "points": points,
        "trained": correlation([p["J"] for p in trained], [p["kl"] for p in trained]),
        "trained_non_random": correlation([p["J"] for p in non_random], [p["kl"] for p in non_random]),
        "untrained": correlation([p["J"] for p in untrained], [p["kl0"] for p in untrained]),
    }


def plot(result: dict[str, Any], path: Path, *, title: str) -> Path:
    """Trained KL (left) and untrained KL (right) against the score, one labelled point per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from models.io.atomic import atomic_write_bytes

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for ax, key, corr, label in ((axes[0], "kl", result["trained"], f"after {result['step']} steps"),
                                 (axes[1], "kl0", result["untrained"], "untrained (step 0)")):
        pts = [p for p in result["points"] if p[key] is not None]
        for p in pts:
            ax.scatter(p["J"], p[key], color="0.6" if p["random"] else "C0", s=28, zorder=3)
            ax.annotate(p["layout"], (p["J"], p[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if corr["pearson"] is not None:
            xs, ys = np.array([p["J"] for p in pts]), np.array([p[key] for p in pts])
            slope, intercept = np.polyfit(xs, ys, 1)
            grid = np.linspace(xs.min(), xs.max(), 2)
            ax.plot(grid, slope * grid + intercept, color="C1", lw=1, ls="--")
            label += f": Pearson {corr['pearson']:+.2f}, Spearman {corr['spearman']:+.2f} (n={corr['n']})"
        ax.set_title(label, fontsize=9)
        ax.set_xlabel(f"co-located score J ({result['units'].upper()} units) at initialisation")
        ax.set_ylabel("KL to the dense model (nats/token)")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _fmt(value: float | None, spec: str = "+.2f") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _corr_row(label: str, corr: dict[str, Any]) -> str:
    return (f"| {label} | {corr['n']} | {_fmt(corr['pearson'])} | {_fmt(corr['pearson_p'], '.2g')} | "
            f"{_fmt(corr['spearman'])} | {_fmt(corr['spearman_p'], '.2g')} |")


def markdown(result: dict[str, Any], plot_name: str) -> str:
    rows = sorted(result["points"], key=lambda p: p["J"])
    step = result["step"]
    lines = [
        f"![KL against the co-located score]({plot_name})",
        "",
        f"| layout | J ({result['units'].upper()}) | KL@0 | KL@{step} |",
        "| --- | --- | --- | --- |",
        *(f"| {p['layout']} | {p['J']:.2f} | {_fmt(p['kl0'], '.4f')} | {_fmt(p['kl'], '.4f')} |" for p in rows),
        "",
        "| correlation of J with | n | Pearson | p | Spearman | p |",
        "| --- | --- | --- | --- | --- | --- |",
        _corr_row(f"KL@{step}, every layout", result["trained"]),
        _corr_row(f"KL@{step}, non-random layouts", result["trained_non_random"]),
        _corr_row("KL@0 (untrained), every layout", result["untrained"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(REPO / "var" / "study-spread"), help="a layout study's --work directory")
    ap.add_argument("--step", type=int, default=None, help="training step (default: the last one reached)")
    ap.add_argument("--units", default="fo", choices=SCORES)
    args = ap.parse_args(argv)
    work = Path(args.work)
    report = json.loads((work / "report.json").read_text())
    result = analyse(report, kl_by_layout(work / "distill" / "metrics.csv"), step=args.step, units=args.units)
    print(json.dumps({k: v for k, v in result.items() if k != "points"}, indent=1))
    print(markdown(result, "score_kl.png"))


if __name__ == "__main__":
    main()
