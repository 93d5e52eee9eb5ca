"""bench/score_kl.py: the §5.2 correlation of the score with the trained KL, from a study's files."""

from __future__ import annotations

import numpy as np
import pytest

from bench import score_kl


def ranks(values):
    order = np.argsort(values)
    out = np.empty(len(values))
    out[order] = np.arange(len(values))
    return out  # no ties in this test


def test_correlations_from_a_partial_study(tmp_path):
    js = {"optimised": 30.0, "anti-optimised": 12.0, "contiguous": 20.0, "random-1000": 19.5, "4-layers": 21.0,
          "unfinished": 25.0}
    report = {"layouts": {n: {"J": 0.0, "scores": {"fo": {"J": j}, "add": {"J": -j}}} for n, j in js.items()}}
    final = {"optimised": 0.8, "anti-optimised": 1.6, "contiguous": 1.1, "random-1000": 1.0, "4-layers": 1.05}
    rows = ["layout,seed,step,kl,ppl,loss,lr"]
    for n, kl in final.items():
        rows += [f"{n},0,0,{4 + js[n] / 100},1,,0", f"{n},0,20,{kl},1,,0"]
    rows.append("unfinished,0,0,4.25,1,,0")
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    result = score_kl.analyse(report, score_kl.kl_by_layout(tmp_path / "metrics.csv"))
    assert result["step"] == 20 and result["trained"]["n"] == 5 and result["untrained"]["n"] == 6
    x = np.array([js[n] for n in final])
    y = np.array(list(final.values()))
    assert result["trained"]["pearson"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert result["trained"]["spearman"] == pytest.approx(np.corrcoef(ranks(x), ranks(y))[0, 1])
    assert result["trained_non_random"]["n"] == 4
    # Untrained KL here rises with J: the sign is what the data says.
    assert result["untrained"]["pearson"] == pytest.approx(1.0)
    add = score_kl.analyse(report, score_kl.kl_by_layout(tmp_path / "metrics.csv"), units="add")
    assert add["trained"]["pearson"] == pytest.approx(-result["trained"]["pearson"])
    text = score_kl.markdown(result, "plot.png")
    assert "| optimised | 30.00 |" in text and "n" in text
    assert score_kl.plot(result, tmp_path / "p.png", title="t").stat().st_size > 1000
