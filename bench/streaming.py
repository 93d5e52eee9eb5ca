"""Streamed vs in-memory passes on a synthetic Llama-shaped checkpoint (bench/synthetic_checkpoint.py):
`dtp-layout optimise` and `dtp-layout export` under `--max-memory` of half the weight bytes, each in its own
subprocess, with its peak RSS (`getrusage(RUSAGE_CHILDREN).ru_maxrss` of a wrapper that runs only it),
against the same commands in memory; outputs compared tensor by tensor (never the whole model in memory).

    python -m bench.streaming --dir /work/tmp/stream-bench --hidden 2048 --intermediate 5632 --layers 24

The interpreter's base is measured the same way: `python -c "import torch"` and the command's own imports
before any weight (torch, transformers, the CLI). The two arms run back to back, streamed first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# Runs argv[2:] and writes its exit status, wall seconds and peak RSS (bytes) to argv[1].
_WRAPPER = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
            "r = subprocess.run(sys.argv[2:]); w = time.perf_counter() - t; "
            "json.dump({'rc': r.returncode, 'wall_s': w, "
            "'peak_rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}, open(sys.argv[1], 'w'))")
COMMAND_IMPORTS = ("import torch, transformers, safetensors; from transformers import AutoModelForCausalLM; "
                   "import app.cli.main, models.run.stages, models.run.pipeline, models.affinity.scoring, "
                   "models.variants.set, "
                   "models.streaming.pipelines, models.export.writer, models.evaluation.evaluate, "
                   "models.data.calibration")


def measured(cmd: list[str], where: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd` alone under the wrapper: {'rc', 'wall_s', 'peak_rss'}."""
    out = where / f".measure-{time.monotonic_ns()}.json"
    subprocess.run([sys.executable, "-c", _WRAPPER, str(out), *cmd], check=False, env=env)
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return result


def base_rss(where: Path) -> dict[str, int]:
    """Peak RSS of the interpreter alone: python + torch, and python + the command's imports."""
    return {"torch": measured([sys.executable, "-c", "import torch"], where)["peak_rss"],
            "command_imports": measured([sys.executable, "-c", COMMAND_IMPORTS], where)["peak_rss"]}


def calibration_ids(path: Path, vocab: int, tokens: int) -> Path:
    np.save(path, np.random.default_rng(0).integers(0, vocab, tokens).astype(np.int64))
    return path


def same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of the safetensors files under a equal (bitwise, same dtype) to b's, one at a time."""
    import torch

    from models.streaming.layer_source import CheckpointReader

    ra, rb = CheckpointReader(a), CheckpointReader(b)
    if set(ra.names()) != set(rb.names()):
        return False
    for name in ra.names():
        x, y = ra.tensor(name), rb.tensor(name)
        if x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return True


def same_affinity(a: Path, b: Path, rtol: float = 1e-5) -> bool:
    from models.affinity.file import AffinityResult

    x, y = AffinityResult.load(a), AffinityResult.load(b)
    pairs = zip(x.up_fo + x.up_add + x.down, y.up_fo + y.up_add + y.down, strict=True)
    return all(np.allclose(p, q, rtol=rtol, atol=0) for p, q in pairs)


def compare(streamed: Path, in_memory: Path, *, optimise: bool) -> dict[str, bool]:
    out = {"checkpoint": same_tensors(streamed / "checkpoint", in_memory / "checkpoint")}
    out["shards"] = same_shards(streamed / "shards", in_memory / "shards")
    if optimise:
        out["affinity"] = same_affinity(streamed / "affinity.safetensors", in_memory / "affinity.safetensors")
        out["layouts"] = all((streamed / "layouts" / p.name).read_text() == p.read_text()
                             for p in (in_memory / "layouts").glob("*.json"))
    return out


def same_shards(a: Path, b: Path) -> bool:
    """Each rank's shard file under a holds the same tensors as b's, one tensor at a time."""
    import torch
    from safetensors import safe_open

    files = sorted(a.glob("model-rank-*.safetensors"))
    if not files or len(files) != len(list(b.glob("model-rank-*.safetensors"))):
        return False
    for rank_file in files:
        with safe_open(str(rank_file), "pt") as fa, safe_open(str(b / rank_file.name), "pt") as fb:
            if set(fa.keys()) != set(fb.keys()):
                return False
            for name in fa.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                x, y = fa.get_tensor(name), fb.get_tensor(name)
                if x.dtype != y.dtype or not torch.equal(x, y):
                    return False
    return True


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", *args]


def run(work: Path, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
        sequences: int, seq_len: int, devices: int = 2, fraction: float = 0.5) -> dict[str, Any]:
    from bench.synthetic_checkpoint import llama_config, write_checkpoint

    work.mkdir(parents=True, exist_ok=True)
    src = work / "model"
    config = llama_config(hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                          kv_heads=kv_heads, vocab=vocab)
    t0 = time.perf_counter()
    weights = write_checkpoint(src, config) if not (src / "config.json").exists() else _weight_bytes(src)
    make_s = time.perf_counter() - t0
    ids = calibration_ids(work / "ids.npy", vocab, sequences * seq_len * 2)
    limit = int(weights * fraction)
    base = base_rss(work)
    common = ["--devices", str(devices), "--calib", str(ids), "--calib-sequences", str(sequences),
              "--calib-seq-len", str(seq_len), "--restarts", "0", "--no-convert-cache", "--device", "cpu"]
    arms: dict[str, Any] = {}
    for arm, extra in (("streamed", ["--max-memory", str(limit)]), ("in_memory", [])):
        out = work / f"optimise-{arm}"
        arms[f"optimise_{arm}"] = measured(cli("optimise", str(src), *common, "--out", str(out), "--overwrite",
                                               *extra), work)
        report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
        arms[f"optimise_{arm}"]["seconds"] = report.get("seconds", {})
    layout = str(work / "optimise-in_memory" / "layouts" / "optimised.json")
    for arm, extra in (("streamed", ["--max-memory", str(limit)]), ("in_memory", [])):
        arms[f"export_{arm}"] = measured(cli("export", str(src), "--devices", str(devices), "--layout", layout,
                                             "--no-convert-cache", "--device", "cpu",
                                             "--out", str(work / f"export-{arm}"), "--overwrite", *extra), work)
    equal = {"optimise": compare(work / "optimise-streamed", work / "optimise-in_memory", optimise=True),
             "export": compare(work / "export-streamed", work / "export-in_memory", optimise=False)}
    s_aff = arms["optimise_streamed"]["seconds"].get("affinity")
    m_aff = arms["optimise_in_memory"]["seconds"].get("affinity")
    return {
        "weights_bytes": weights, "limit_bytes": limit, "base_rss": base, "make_checkpoint_s": round(make_s, 1),
        "calibration_tokens": sequences * seq_len, "arms": arms, "equal": equal,
        "affinity_time_ratio": (s_aff / m_aff) if s_aff and m_aff else None,
        "peak_over_weights": {k: v["peak_rss"] / weights for k, v in arms.items()},
        "peak_minus_base_over_weights": {k: (v["peak_rss"] - base["command_imports"]) / weights
                                         for k, v in arms.items()},
        "under_limit_plus_base": {k: v["peak_rss"] <= limit + base["command_imports"]
                                  for k, v in arms.items() if "streamed" in k},
    }


def _weight_bytes(src: Path) -> int:
    from models.streaming.layer_source import CheckpointReader

    reader = CheckpointReader(src)
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    total = 0
    for info in reader.tensors.values():
        n = 1
        for s in info.shape:
            n *= s
        total += n * sizes[info.dtype]
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="work directory (the checkpoint is kept for reruns)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    result = run(args.dir, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                 kv_heads=args.kv_heads, vocab=args.vocab, sequences=args.sequences, seq_len=args.seq_len)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
