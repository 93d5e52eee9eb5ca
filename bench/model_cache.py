"""One conversion per model: load time and peak memory of a GGUF model loaded directly (dequantised
every time: what a job does today), converted into an empty cache (the first job), and from the
converted copy (every later job).

Each load runs in a fresh Python process (`--child`), so its peak RSS (`ru_maxrss`) is its own; the
process's RSS after the imports (torch, transformers) is reported too, so the model's share shows.
A load is what a job's loading stage does with the model: the config, the weights, the tokenizer;
then every weight is read once (`read all`: a copy loaded memory-mapped is read at first use, which
the load time alone would not show), and the peak RSS is taken after that read. A cycle is direct,
first (an empty cache), second (the copy the first made); `--repeats` cycles, each on a fresh cache
directory, medians reported. The GGUF file is in the page cache after the first read, for all three
alike, and so is the copy just written.

    .venv/bin/python bench/model_cache.py                       # the packaged SmolLM2-135M GGUF, fp32
    .venv/bin/python bench/model_cache.py --gguf FILE --dtype bfloat16 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODES = ("direct", "first", "second")


def rss_mb() -> float:
    """The current resident set size, MiB (from /proc; the peak is ru_maxrss)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, gguf: str, root: str, dtype: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    from models.io.converted import ConvertedCache
    from models.io.loading import ModelSource, load_config, load_model, load_tokenizer

    base = rss_mb()
    t0 = time.perf_counter()
    source = ModelSource(gguf)
    if mode != "direct":
        source = ConvertedCache(Path(root)).converted_source(source, dtype=dtype)
    t_key = time.perf_counter()
    load_config(source)
    model = load_model(source, dtype=dtype)
    t_model = time.perf_counter()
    tokenizer = load_tokenizer(source)
    t_end = time.perf_counter()
    # from_pretrained may leave safetensors weights memory-mapped, read at their first use: read every
    # one now, so that the second load is not credited with reads a job's first forward would pay.
    peak_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with torch.no_grad():
        checksum = sum(float(p.sum()) for p in model.parameters())  # a reduction: no copy of the weights
    t_touch = time.perf_counter()
    return {"mode": mode, "seconds": t_end - t0, "touch_s": t_touch - t_end, "checksum": checksum,
            "peak_rss_loaded_mb": peak_loaded, "convert_or_lookup_s": t_key - t0, "model_s": t_model - t_key,
            "tokenizer_s": t_end - t_model, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "base_rss_mb": base, "params": sum(p.numel() for p in model.parameters()),
            "tokenizer": tokenizer is not None}


def run_child(mode: str, gguf: Path, root: Path, dtype: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--gguf", str(gguf), "--root", str(root),
                           "--dtype", dtype], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} load failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", help="GGUF file (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3, help="cycles of direct, first, second (default: 3)")
    p.add_argument("--root", help="cache directory (default: a temporary one per cycle, removed)")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.gguf, args.root, args.dtype)))
        return 0

    from models.io.assets import smollm2_gguf

    gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
    runs: list[dict[str, Any]] = []
    entry_bytes = 0
    for cycle in range(args.repeats):
        root = Path(args.root) / f"cycle-{cycle}" if args.root else Path(tempfile.mkdtemp(prefix="dtp-converted-"))
        try:
            for mode in MODES:
                runs.append({**run_child(mode, gguf, root, args.dtype), "cycle": cycle,
                             "loadavg": round(os.getloadavg()[0], 2)})
                print(f"cycle {cycle} {mode:7s} {runs[-1]['seconds']:7.2f} s  peak RSS "
                      f"{runs[-1]['peak_rss_mb']:6.0f} MiB  (load average {runs[-1]['loadavg']})", flush=True)
            entry_bytes = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
        finally:
            if not args.root:
                shutil.rmtree(root, ignore_errors=True)

    def med(mode: str, field: str) -> float:
        return statistics.median(r[field] for r in runs if r["mode"] == mode)

    print(f"\n{gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB), {args.dtype}, {args.repeats} cycles, medians")
    print(f"{'load':8s} {'total s':>8s} {'convert/key s':>14s} {'model s':>8s} {'tokenizer s':>12s} "
          f"{'read all s':>11s} {'peak RSS MiB':>13s} {'(loaded)':>9s} {'base RSS MiB':>13s}")
    for mode in MODES:
        print(f"{mode:8s} {med(mode, 'seconds'):8.2f} {med(mode, 'convert_or_lookup_s'):14.2f} "
              f"{med(mode, 'model_s'):8.2f} {med(mode, 'tokenizer_s'):12.2f} {med(mode, 'touch_s'):11.2f} "
              f"{med(mode, 'peak_rss_mb'):13.0f} {med(mode, 'peak_rss_loaded_mb'):9.0f} "
              f"{med(mode, 'base_rss_mb'):13.0f}")
    checksums = {r["checksum"] for r in runs}
    print(f"weights checksum equal in every load: {len(checksums) == 1}")
    second_first = med("second", "seconds") / med("first", "seconds")
    second_direct = med("second", "seconds") / med("direct", "seconds")
    with_reads = ((med("second", "seconds") + med("second", "touch_s"))
                  / (med("first", "seconds") + med("first", "touch_s")))
    print(f"second / first  {second_first:.3f}   (goal ≤ 0.1)")
    print(f"second / direct {second_direct:.3f}")
    print(f"second / first, every weight read after the load: {with_reads:.3f}")
    print(f"converted copy on disk: {entry_bytes / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps({"gguf": str(gguf), "dtype": args.dtype, "runs": runs,
                                               "second_over_first": second_first,
                                               "second_over_direct": second_direct,
                                               "second_over_first_with_reads": with_reads,
                                               "entry_bytes": entry_bytes}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
