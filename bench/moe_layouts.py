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

    .venv/bin/python bench/moe_layouts.py                 # the fixed setup (hours on this CPU: as the schedule
                                                          # experiment's cpu preset, 15 runs of dtp:1)
    .venv/bin/python bench/moe_layouts.py --quick         # smoke: 2 layers, 2 steps, 2 seeds (minutes)
    .venv/bin/python bench/moe_layouts.py --step0-only    # every arm's KL before training, no verdict
    .venv/bin/python -m bench.moe_layouts verdict FILE    # the verdict recomputed from a runs file alone

The converted model is kept in WORK/model (remade only when missing), the schedule experiment's work (affinity,
layouts, runs; resumable) in WORK/experiment, the runs file (the verdict's only input) in WORK/runs, and the
summary in WORK/result.json; WORK is var/moe-layouts, or var/moe-layouts-quick with --quick.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.schedule_verdicts import AMENDED_RULE, Run, amended_verdict, load_runs

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


# ---- the run --------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
# The smoke run: the first 2 layers converted on 4 × 128 tokens, the schedule experiment's quick budget with the
# rule's layout counts (2 optimised from 2 restarts, 2 random) and 2 seeds: every piece runs, the verdict means
# nothing.
QUICK_LAYERS = 2
QUICK_CONVERSION = {"source": "corpus:kjv", "blocks": 4, "seq_len": 128}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench/moe_layouts.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the smoke run (QUICK_LAYERS layers, 2 steps, 2 seeds)")
    ap.add_argument("--step0-only", action="store_true", help="every arm's KL before training; no verdict")
    ap.add_argument("--work", type=Path, default=None, help="default var/moe-layouts[-quick]")
    ap.add_argument("--device", default="auto", help="where the model runs (the schedule experiment's --device)")
    args = ap.parse_args(list(argv))
    args.work = args.work or REPO / "var" / ("moe-layouts-quick" if args.quick else "moe-layouts")
    return args


def converted_model(args: argparse.Namespace) -> Path:
    """WORK/model: the converted Mixtral (made by bench/moefication.py when it is not there yet)."""
    from bench import moefication

    out = args.work / "model"
    if not (out / moefication.CONVERSION_FILE).exists():
        calib = QUICK_CONVERSION if args.quick else CONVERSION_CALIBRATION
        argv = ["--out", str(out), "--experts", str(EXPERTS), "--top-k", str(TOP_K), "--seed", str(CONVERSION_SEED),
                "--calib", calib["source"], "--calib-blocks", str(calib["blocks"]), "--seq-len", str(calib["seq_len"]),
                "--eval-blocks", str(calib["blocks"]), "--kl-k", f"1,{TOP_K},{EXPERTS // 2},{EXPERTS}"]
        moefication.main(argv + (["--layers", str(QUICK_LAYERS)] if args.quick else []))
    return out


def check_moe_support(model_dir: Path) -> None:
    """The layout pipeline must know the converted model's family (issue 46's mixtral family): refused otherwise,
    naming what is missing, before any long step."""
    from models.families import UnsupportedModelError
    from models.io.loading import ModelLoadError, ModelSource, load_config

    try:
        load_config(ModelSource(str(model_dir)))
    except (ModelLoadError, UnsupportedModelError) as exc:
        raise SystemExit(f"{model_dir}: the layout pipeline cannot take the converted Mixtral yet ({exc}); "
                         "it needs issue 46's mixtral family, MoE affinity, optimiser and distillation") from None


def experiment_argv(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """bench/schedule_experiment.py's flags for the fixed setup (or the smoke run) on the converted model."""
    argv = ["--model", str(model_dir), "--schedules", SCHEDULE, "--devices", str(DEVICES), "--device", args.device,
            "--optimised-layouts", str(OPTIMISED_LAYOUTS), "--random-layouts", str(RANDOM_LAYOUTS),
            "--work", str(args.work / "experiment"), "--runs-dir", str(args.work / "runs")]
    if args.quick:  # the quick preset's one layout per arm and 0 restarts would leave the rule nothing to read
        argv += ["--preset", "quick", "--restarts", "2", "--seeds", "0,1"]
    else:
        argv += ["--preset", PRESET, "--seeds", ",".join(map(str, SEEDS))]
    return argv + (["--step0-only"] if args.step0_only else [])


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["verdict"]:
        return verdict_main(argv[1:])
    args = parse_args(argv)
    print(f"rule (fixed before the runs, bench/moe_layouts.py): {RULE}", flush=True)
    model_dir = converted_model(args)
    check_moe_support(model_dir)
    from bench.schedule_experiment import parse_args as experiment_args
    from bench.schedule_experiment_runs import Experiment

    experiment = Experiment(experiment_args(experiment_argv(args, model_dir)))
    row = experiment.run(SCHEDULE)
    conversion = json.loads((model_dir / "moefication.json").read_text())
    summary: dict[str, Any] = {
        "rule": RULE, "quick": args.quick, "model": str(model_dir),
        "conversion": {k: conversion.get(k) for k in ("experts", "top_k", "seed", "calibration", "kl_to_dense")},
        "schedule": SCHEDULE, "devices": DEVICES}
    if args.step0_only:
        summary["step0_kl"] = row["step0_kl"]
    else:
        said = verdict(experiment.runs(SCHEDULE, row["curves"]))
        summary |= {"final_kl": row["final_kl"], "final_kl_second_domain": row["final_kl_second_domain"],
                    "verdict": said}
        print(f"{SCHEDULE} on the converted MoE: {said['verdict']} ({said['why']})", flush=True)
    (args.work / "result.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def verdict_main(argv: Sequence[str]) -> dict[str, Any]:
    """`python -m bench.moe_layouts verdict FILE`: the rule on a runs file alone (no model loaded)."""
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.moe_layouts verdict RUNS_FILE (WORK/runs/dtp-1-<steps>steps.json)")
    about, runs = load_runs(Path(argv[0]))
    said = verdict(runs)
    print(json.dumps({"schedule": about.get("schedule"), "steps": about.get("steps"), **said}, indent=1, default=str))
    return said


if __name__ == "__main__":
    main()
