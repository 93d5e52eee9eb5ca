"""Issue 29: at what calibration size has the dtp:1 objective converged on SmolLM2-135M?

The affinity scores are per-token means (models.affinity.file), so the affinity of N equal blocks is the
mean of the N blocks' affinities: the pass runs once per block of `--seq-len` tokens (each kept in the work
directory; a rerun computes only what is missing) and every calibration size 1, 2, 4, … blocks reuses them.
Per size: the dtp:1-optimised layout, its J on its own calibration blocks and its **held-out J** (scored
on the mean affinity of `--heldout-blocks` further blocks of the same text, never used to optimise), with
contiguous and a random layout scored on the same held-out affinity for scale.

Rule fixed before the run (printed): the converged size is the smallest measured size whose held-out J is
within `--tolerance` (1 %) of the held-out J of every larger size measured. With the largest size below the
paper's 65,536 tokens, "converged" means "no further gain up to the largest size measured", not beyond.

    OMP_NUM_THREADS=2 .venv/bin/python bench/calibration_sweep.py --sizes 1,2,4,8,16,32,64
    .venv/bin/python bench/calibration_sweep.py --quick          # a tiny random model, seconds
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
RULE = ("the converged calibration size is the smallest measured size whose held-out J is within {tol:.0%} of the "
        "held-out J of every larger measured size")
KL_RULE = ("after distillation, one arm is better than another only if every seed of it ends below every seed of the "
           "other; the default calibration size stands if no larger size is better than it, and more calibration "
           "lowers the KL only where a larger size is better than a smaller one")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M GGUF")
    ap.add_argument("--devices", type=int, default=3)
    ap.add_argument("--text", default="corpus:kjv")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64", help="calibration sizes in blocks (nested prefixes)")
    ap.add_argument("--heldout-blocks", type=int, default=8, help="blocks never optimised on")
    ap.add_argument("--heldout-start", type=int, default=128, help="the first held-out block (after every size)")
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--distill-sizes", default="", help="calibration sizes (blocks) whose optimised layouts are "
                    "also distilled, with contiguous, under dtp:1 (e.g. 1,4,16,64); empty: none")
    ap.add_argument("--distill-steps", type=int, default=40)
    ap.add_argument("--distill-seeds", default="0")
    ap.add_argument("--quick", action="store_true", help="a tiny random llama and 32-token blocks: a smoke run")
    ap.add_argument("--work", default=None, help="default var/calibration-sweep[-quick]")
    args = ap.parse_args(argv)
    if args.quick:
        args.seq_len, args.sizes, args.heldout_blocks, args.restarts, args.devices = 32, "1,2,4", 2, 0, 2
        args.heldout_start, args.distill_steps = 4, 2
    args.work = Path(args.work or REPO / "var" / ("calibration-sweep-quick" if args.quick else "calibration-sweep"))
    return args


def mean_affinity(results: list[Any]) -> Any:
    """The affinity of the blocks together: the mean of equal-token blocks' per-token means."""
    from models.affinity.file import AffinityResult

    first = results[0]

    def avg(name: str) -> list[np.ndarray]:
        return [np.mean([getattr(r, name)[i] for r in results], axis=0) for i in range(len(getattr(first, name)))]

    return AffinityResult(avg("up_fo"), avg("up_add"), avg("down"), sum(r.tokens for r in results), first.shape,
                          dict(first.metadata))


def kl_separations(final_kl: dict[str, dict[int, float]]) -> list[tuple[str, str]]:
    """(better, worse) for every pair of arms where every seed of the first ends below every seed of the
    second (KL_RULE); arms with different seed sets are not compared."""
    return [(a, b) for a, by_a in final_kl.items() for b, by_b in final_kl.items()
            if a != b and by_a and set(by_a) == set(by_b) and max(by_a.values()) < min(by_b.values())]


def converged_size(heldout: dict[int, float], tolerance: float) -> int | None:
    """RULE: the smallest size within `tolerance` of every larger size's held-out J (None: not one)."""
    sizes = sorted(heldout)
    for i, size in enumerate(sizes[:-1]):
        if all(abs(heldout[size] - heldout[b]) <= tolerance * abs(heldout[b]) for b in sizes[i + 1:]):
            return size
    return None


class Sweep:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from models.io.loading import ModelSource, load_model, load_tokenizer

        self.args = args
        if args.quick:
            from tests.tiny import tiny_model  # a random model: the smoke run needs no download

            self.model, self.tokenizer = tiny_model("llama"), None
        else:
            if args.model is None:
                from models.io.assets import smollm2_gguf

                args.model = str(smollm2_gguf())
            source = ModelSource(args.model)
            self.model, self.tokenizer = load_model(source).eval(), load_tokenizer(source)
        torch.manual_seed(0)

    def block_tokens(self, index: int) -> Any:
        import torch

        from models.data.calibration import CalibrationSpec, load_blocks

        vocab = int(self.model.config.vocab_size)
        if self.tokenizer is None:
            return torch.randint(0, vocab, (1, self.args.seq_len), generator=torch.Generator().manual_seed(index))
        spec = CalibrationSpec(source=self.args.text, sequences=1, seq_len=self.args.seq_len, skip_blocks=index)
        return load_blocks(spec, self.tokenizer, vocab_size=vocab)

    def block(self, index: int) -> Any:
        """Block `index`'s affinity (dtp:1's chain edges), computed once and kept."""
        from models.affinity.file import AffinityResult
        from models.run import pipeline
        from models.schedules.grammar import dtp_spec

        path = self.args.work / "blocks" / f"block-{index:03d}.safetensors"
        if not path.exists():
            t0 = time.perf_counter()
            spec = pipeline.OptimiseSpec(devices=self.args.devices, schedule=dtp_spec(1), export=False)
            result = pipeline.run_affinity(self.model, self.block_tokens(index), schedule=None, spec=spec,
                                           metadata={"block": str(index)})
            path.parent.mkdir(parents=True, exist_ok=True)
            result.save(path)
            print(f"block {index}: {time.perf_counter() - t0:.0f} s", flush=True)
        return AffinityResult.load(path)

    def run(self) -> dict[str, Any]:
        from models.variants.set import build_layouts, score_both

        a = self.args
        sizes = sorted(int(s) for s in a.sizes.split(","))
        if a.heldout_start < sizes[-1]:
            raise SystemExit(f"--heldout-start {a.heldout_start} overlaps the calibration blocks 0..{sizes[-1] - 1}")
        heldout_ids = range(a.heldout_start, a.heldout_start + a.heldout_blocks)
        heldout = mean_affinity([self.block(i) for i in heldout_ids])  # first: the yardstick

        def j_on(result: Any, lay: Any) -> float:
            return float(score_both(result, lay.kv_group_device, lay.neuron_device, a.devices)["fo"]["J"])

        rows, layouts = [], {}
        for size in sizes:
            calibration = mean_affinity([self.block(i) for i in range(size)])
            built = build_layouts(calibration, devices=a.devices, delta=1, restarts=a.restarts, random_layouts=1)
            optimised = built["optimised"]
            layouts[size] = optimised.with_name(f"calibrated-{size * a.seq_len}")
            row = {"blocks": size, "tokens": size * a.seq_len, "J_calibration": j_on(calibration, optimised),
                   "J_heldout": j_on(heldout, optimised)}
            for name, lay in built.items():
                if name != "optimised":
                    row[f"J_heldout_{name.split('-')[0]}"] = j_on(heldout, lay)
            rows.append(row)
            print(json.dumps(row), flush=True)
        by_size = {r["tokens"]: r["J_heldout"] for r in rows}
        out = {"rule": RULE.format(tol=a.tolerance), "devices": a.devices, "text": a.text, "seq_len": a.seq_len,
               "heldout_tokens": a.heldout_blocks * a.seq_len, "rows": rows,
               "converged_tokens": converged_size(by_size, a.tolerance)}
        if a.distill_sizes:
            out["distill"] = self.distill([int(s) for s in a.distill_sizes.split(",")], layouts)
        a.work.mkdir(parents=True, exist_ok=True)
        (a.work / "results.json").write_text(json.dumps(out, indent=1))
        return out

    def distill(self, sizes: list[int], layouts: dict[int, Any]) -> dict[str, Any]:
        """The chosen sizes' optimised layouts and contiguous, each distilled under dtp:1 with the same seeds
        and recipe (the study's 40 steps of 2 × 64 tokens), KL on 64 × 64 held-out tokens of the same text:
        {layout: {seed: final KL}}."""
        from models import distill
        from models.data.calibration import CalibrationSpec
        from models.schedules.grammar import dtp_spec

        a = self.args
        paths = []
        for size in sizes:
            path = a.work / "layouts" / f"{layouts[size].name}.json"
            layouts[size].save(path)
            paths.append(str(path))
        seq_len, batch = (16, 1) if a.quick else (64, 2)
        recipe = distill.DistillRecipe(steps=a.distill_steps, batch_size=batch, micro_batch_size=batch, lr=1e-4,
                                       min_lr=1e-5, warmup_steps=max(1, a.distill_steps // 10),
                                       eval_every=a.distill_steps, eval_batch_size=4)
        spec = distill.DistillSpec(
            layouts=(*paths, "contiguous"), devices=a.devices, delta=1, schedule=dtp_spec(1),
            seeds=tuple(int(s) for s in a.distill_seeds.split(",")), recipe=recipe,
            train=CalibrationSpec(source=a.text, sequences=a.distill_steps * batch, seq_len=seq_len),
            eval=CalibrationSpec(source=a.text, sequences=4 if a.quick else 64, seq_len=seq_len),
            calibration=CalibrationSpec(source=a.text, sequences=max(sizes), seq_len=a.seq_len))
        if self.tokenizer is None:  # the smoke run: token ids in files, as the data specs take them
            spec = self._token_files(spec)
        summary = distill.run_distill(spec, teacher=self.model, tokenizer=self.tokenizer, out_dir=a.work / "distill",
                                      keep_checkpoints=False, plot=False)
        finals: dict[str, dict[int, float]] = {}
        for path in sorted((a.work / "distill" / "runs").glob("*/seed-*/metrics.json")):
            last = json.loads(path.read_text())["records"][-1]
            finals.setdefault(last["layout"], {})[int(last["seed"])] = float(last["kl"])
        separated = kl_separations(finals)
        print(json.dumps({"distill_final_kl": finals}), flush=True)
        print("rule (fixed before the run): " + KL_RULE, flush=True)
        print("separated (better < worse): " + (", ".join(f"{b} < {w}" for b, w in separated) or "none"), flush=True)
        return {"steps": a.distill_steps, "final_kl": finals, "dense_ppl": summary.get("dense_ppl"),
                "rule": KL_RULE, "separated": [list(pair) for pair in separated]}

    def _token_files(self, spec: Any) -> Any:
        import dataclasses

        import numpy as np

        ids = np.random.default_rng(0).integers(0, int(self.model.config.vocab_size), size=4096)
        path = self.args.work / "tokens.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, ids)
        return dataclasses.replace(spec, train=dataclasses.replace(spec.train, source=str(path)),
                                   eval=dataclasses.replace(spec.eval, source=str(path)),
                                   calibration=dataclasses.replace(spec.calibration, source=str(path)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print("rule (fixed before the run): " + RULE.format(tol=args.tolerance), flush=True)
    out = Sweep(args).run()
    print(f"converged at {out['converged_tokens']} tokens", flush=True)
    return out


if __name__ == "__main__":
    main()
