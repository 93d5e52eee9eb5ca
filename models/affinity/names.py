"""The two up-edge affinity scores of §3: `fo` (first order) and `add`.

The one list of score names the affinity pass, the affinity file, the layout set, the CLI and the API
accept. Dependency-free, so the API's schema and the CLI's help read it without numpy or torch.
"""

from __future__ import annotations

from typing import Literal, get_args

ScoreName = Literal["fo", "add"]
SCORES: tuple[ScoreName, ...] = get_args(ScoreName)


def other_score(score_name: str) -> ScoreName:
    """The score a run does not use (the `add-score` / `fo-score` ablation optimises on it)."""
    return "add" if score_name == "fo" else "fo"
