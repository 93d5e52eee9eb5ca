"""Rescoring saved layouts on a saved affinity (the `dtp-layout score` command), without torch.

For each layout: J of objective (6) in the chosen up-edge units (fo or add), J over the upper bound,
the random expectation, and the co-located fraction of every up edge (layer i's KV groups → its
neurons) and down edge (layer i's neurons → layer i+1's KV groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.affinity_file import AffinityResult
from models.layouts import layout as layout_mod
from models.layouts.format import LayoutError
from models.layouts.set import affinity_for
from models.optimise import score, upper_bound

SCORES_FORMAT = "dtp-layout-scores/1"


def rescore(affinity_path: str | Path, layout_paths: Sequence[str | Path], *, score_name: str = "fo") -> dict[str, Any]:
    """{format, affinity, score, tokens, layouts: [{name, path, devices, J, J_over_bound, …}]}.

    ValueError (LayoutError for a layout) naming the file when a file is unreadable or does not fit the
    affinity's model shape.
    """
    result = AffinityResult.load(affinity_path)
    affinity = affinity_for(result, score_name)
    rows = []
    for path in layout_paths:
        lay = layout_mod.load(path)
        try:
            layout_mod.check_fits(lay, result.shape)
        except LayoutError as exc:
            raise LayoutError(f"{path}: {exc} (affinity {affinity_path})") from exc
        bound = upper_bound(affinity, lay.devices)
        rep = score(affinity, lay.kv_group_device, lay.neuron_device, devices=lay.devices, bound=bound)
        rows.append({"name": lay.name, "path": str(path), "devices": lay.devices, "J": rep.J,
                     "J_over_bound": rep.J / rep.upper_bound if rep.upper_bound else None,
                     "random_expectation": rep.random_expectation, "upper_bound": rep.upper_bound,
                     "upper_bound_exact": rep.upper_bound_exact, "up_fraction": rep.up_fraction,
                     "down_fraction": rep.down_fraction})
    return {"format": SCORES_FORMAT, "affinity": str(affinity_path), "score": score_name, "tokens": result.tokens,
            "num_layers": result.shape.num_layers, "layouts": rows}


def score_table(doc: dict[str, Any]) -> str:
    """The summary (one row per layout) and the per-layer up/down co-located fractions (one column each)."""
    rows = doc["layouts"]
    width = max(12, *(len(r["name"]) + 2 for r in rows))
    lines = [f"J in {doc['score'].upper()} units, {doc['tokens']} calibration tokens ({doc['affinity']})",
             f"{'layout':<{width}}{'L':>4}{'J':>10}{'J/bound':>9}{'random':>9}{'bound':>9}"]
    for r in rows:
        ratio = f"{r['J_over_bound']:.3f}" if r["J_over_bound"] is not None else "–"
        bound = f"{r['upper_bound']:.3f}" + ("" if r["upper_bound_exact"] else "*")
        lines.append(f"{r['name']:<{width}}{r['devices']:>4}{r['J']:>10.3f}{ratio:>9}"
                     f"{r['random_expectation']:>9.3f}{bound:>9}")
    if any(not r["upper_bound_exact"] for r in rows):
        lines.append("* relaxed bound (too many KV-group partitions to enumerate)")
    col = max(11, *(len(r["name"]) + 1 for r in rows))
    lines += ["", "co-located fraction per layer, up / down edge",
              "layer" + "".join(f"{r['name']:>{col}}" for r in rows)]
    for i in range(doc["num_layers"]):
        cells = []
        for r in rows:
            down = f"{r['down_fraction'][i]:.2f}" if i < len(r["down_fraction"]) else "  – "
            cells.append(f"{r['up_fraction'][i]:.2f} / {down}".rjust(col))
        lines.append(f"{i:<5}" + "".join(cells))
    return "\n".join(lines)
