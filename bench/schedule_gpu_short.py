"""The GPU preset's short run (issue 45), made to travel to a lent GPU machine.

`--preset gpu` (300 steps of 8 × 512 for every schedule) needs hours, the packaged 94 MB GGUF and the corpora
on the GPU machine; a lent machine takes at most 64 MiB a call (the working tree included), 10 minutes a
command and 15 minutes of device time in all. `--preset gpu-short` is the part that fits: dtp:1 only, its
optimised layout against contiguous and random-1000, seeds 0, 1, 2, 100 steps of 8 × 512 tokens, KL on
16 × 512 held-out tokens of each domain, the primary every 10 steps (9 runs, meant to take under 8 minutes).

`prepare` does here, on the CPU, everything that is not training: the dtp:1 affinity and the three layouts
(in the work directory, as the experiment keeps them), the token files (uint16 .npy: the calibration blocks,
the training blocks and both held-out evaluation sets, placed as the experiment places them), and the GGUF
split into two parts of at most PART_BYTES, since it is larger than one call may carry. The run on the GPU
machine then reads only these files:

    .venv/bin/python -m bench.schedule_gpu_short prepare          # here: var/gpu-short/, a few CPU minutes
    make gpu-wheels                                                # .whl/: gguf, the one package the image lacks
    # device call 1, carry ["var/gpu-short/model.part-1"]:  true
    # device call 2 (the machine still warm), carry ["var/gpu-short/model.part-2", "var/gpu-short/data",
    #   "var/gpu-short/work/layouts", ".whl/gguf-0.19.0-py3-none-any.whl"], timeout_s 540:
    #   OUT=$OUT bash bench/schedule_gpu_short.sh
    .venv/bin/python -m bench.schedule_experiment verdicts --runs DIR   # the runs file it sent back

The affinity (tens of MB) stays here: the run recomputes it from calib.npy for the objectives' columns only;
the layouts it trains are the carried ones.

Not run on a GPU yet: no machine was lent to the session that wrote it (docs/schedules.md).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "var" / "gpu-short"
PART_BYTES = 50 * 2**20  # with the ~10 MiB working tree, under a call's 64 MiB (the second part goes with ~5 MiB more)
SCHEDULE = "dtp:1"
DATA_FILES = ("calib", "train", "eval", "eval2")


def experiment_flags(out: Path) -> list[str]:
    """The experiment's command line on the token files and work directory `out` holds (here and there)."""
    data = out / "data"
    return ["--preset", "gpu-short", "--schedules", SCHEDULE, "--work", str(out / "work"),
            *(f"--{name}={data / f'{name}.npy'}" for name in DATA_FILES)]


def save_tokens(path: Path, blocks: Any) -> None:
    """Token ids as uint16 (the vocabulary is 49,152), in block order: the .npy source reads them as a stream."""
    ids = np.asarray(blocks).reshape(-1)
    if ids.max() >= 2**16:
        raise ValueError(f"{path.name}: a token id {int(ids.max())} does not fit uint16")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, ids.astype(np.uint16))


def split(model: Path, out: Path) -> list[Path]:
    """The model file in parts of at most PART_BYTES (`cat` joins them)."""
    parts: list[Path] = []
    with model.open("rb") as src:
        while chunk := src.read(PART_BYTES):
            parts.append(out / f"model.part-{len(parts) + 1}")
            parts[-1].write_bytes(chunk)
    return parts


def prepare(out: Path, flags: list[str]) -> dict[str, Any]:
    """The token files, the layouts (with their affinity) and the model's parts under `out`; `flags` are more
    of the experiment's (--model, or a smaller setup)."""
    from bench.schedule_experiment import parse_args
    from bench.schedule_experiment_runs import Experiment
    from models.data.calibration import CalibrationSpec, load_blocks
    from models.distill.data import place_data

    corpus = parse_args(["--preset", "gpu-short", "--device", "cpu", "--work", str(out / "work"), *flags])
    experiment = Experiment(corpus)
    placed = place_data(experiment.distill_spec(SCHEDULE, "optimised", 0))  # held out as the experiment holds out
    vocab = int(experiment.model.config.vocab_size)
    if placed.train is None:
        raise SystemExit("no training blocks placed")
    blocks = {"calib": experiment.blocks(), "train": load_blocks(placed.train, experiment.tokenizer, vocab_size=vocab),
              "eval": load_blocks(placed.eval, experiment.tokenizer, vocab_size=vocab),
              "eval2": load_blocks(CalibrationSpec(source=corpus.eval2, sequences=corpus.eval2_blocks,
                                                   seq_len=corpus.seq_len), experiment.tokenizer, vocab_size=vocab)}
    for name, ids in blocks.items():
        save_tokens(out / "data" / f"{name}.npy", ids)
    # optimised on the corpus's calibration blocks, the ids calib.npy holds: the GPU run finds them made
    layouts = sorted(p.name for p in experiment.layouts(SCHEDULE).glob("*.json"))
    model = Path(corpus.model)
    parts = split(model, out) if model.is_file() else []  # a model directory (the tests') is not carried
    return {"tokens": {name: int(b.numel()) for name, b in blocks.items()}, "layouts": layouts,
            "parts": [p.name for p in parts], "model": model.name}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prepare", "flags"],
                    help="prepare: make the files here; flags: print the experiment's flags for the GPU run")
    ap.add_argument("--out", type=Path, default=OUT)
    args, flags = ap.parse_known_args(argv)  # the rest: the experiment's own flags (--model, a smaller setup)
    if args.what == "flags":
        print(" ".join(experiment_flags(args.out)))
        return {}
    shutil.rmtree(args.out / "data", ignore_errors=True)
    made = prepare(args.out, flags)
    print(made)
    return made


if __name__ == "__main__":
    main()
