"""Issue 46's evidence: does the optimised layout of a mixture-of-experts model train better under dtp:1 at L = 3
than the contiguous and random layouts?

No trained MoE's weights are reachable here, so the model is the packaged SmolLM2-135M converted into a Mixtral
by bench/moefication.py (MoEfication: each FFN's neurons clustered by co-activation into experts, a fitted router,
top-k). The rule and the setup below are fixed here, committed before any run under them:

- MODEL: SmolLM2-135M-Instruct (the packaged Q4_1 GGUF, dequantised to fp32), every layer converted into
  E = 8 experts of 192 neurons, top-2 per token, conversion seed 0, calibrated on the first 16 × 256 tokens of
  corpus:kjv (inside the schedule experiment's calibration blocks, so training and evaluation text is held out
  from it too); its KL to the dense model on held-out text is reported beside the verdict, not judged.
- SCHEDULE and LAYOUTS: dtp:1 on L = 3 devices, layouts of issue 46's unit (each expert's neurons, I_e/L of every
  expert per device). Arms: optimised (two layouts: the optimiser's restarts drawn with seed 0, `optimised`, and
  with seed 1, `optimised-seed1`), contiguous, random (two layouts: `random-1000`, `random-1001`).
- TRAINING: every layout distilled under dtp:1 from the converted MoE (the teacher) with every seed of 0, 1, 2,
  on bench/schedule_experiment.py's `cpu` preset (50 steps of 4 × 64 tokens of corpus:kjv, lr 1e-4, KL on 64 × 64
  held-out tokens every 10 steps; Shakespeare's plays evaluated after the last step).
- VERDICT: the amended rule of the schedule experiment (bench/schedule_verdicts.py AMENDED_RULE) on these runs,
  unchanged: "helps" only if every optimised run ends below every contiguous and every random run and reaches
  contiguous's mean final KL at least 1.5x sooner (interpolated); "not applicable at this budget" where training
  lowers no arm; "not decided" with fewer than 2 optimised or 2 random layouts; otherwise "not shown at this
  budget". The step-0 KL of each arm (no training) is reported, not judged.

What it cannot show, whatever it says: a converted MoE is not a trained MoE. Its experts are slices of one dense
FFN whose neurons were trained to work together, its router was fitted afterwards by least squares, and its gate
weights are near-uniform by construction; a trained MoE's experts and router co-adapted, so its head-to-expert
dependencies may be denser or sparser than these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.schedule_verdicts import AMENDED_RULE, Run, amended_verdict

SCHEDULE = "dtp:1"
DEVICES = 3
EXPERTS, TOP_K, CONVERSION_SEED = 8, 2, 0
CONVERSION_CALIBRATION = {"source": "corpus:kjv", "blocks": 16, "seq_len": 256}
SEEDS = (0, 1, 2)
OPTIMISED_LAYOUTS, RANDOM_LAYOUTS = 2, 2
PRESET = "cpu"  # bench/schedule_experiment.py's budget
RULE = AMENDED_RULE


def verdict(runs: Sequence[Run]) -> dict[str, Any]:
    """The fixed rule (RULE: the schedule experiment's amended rule, unchanged) on the MoE runs."""
    return amended_verdict(runs)
