"""vLLM serving: time to first token and decode tokens/s, plain TP against each DTP schedule (issue 28).

One random fp32 llama (by default 4 layers, hidden 512, head_dim 64) exported once per schedule; each
engine is vLLM's OpenAI server from .venv-vllm (TP = 2, eager, CPU), one at a time: plain TP serves the
permuted checkpoint/ as vLLM's own Llama, every DTP schedule its shards/. Per engine, after one warm-up:

    ttft_ms     a 1-token completion of a PROMPT-token prompt (prefill + the first token)
    decode_tps  one prompt, (N-1) tokens over the time after the first: (t_N - t_1)
    batch_tps   B prompts in one request, B·N tokens over the wall time

each repeated R times: the median and the spread (min..max). On the shared 2-core machine the absolute
numbers are the machine's load as much as the model's; compare within one run.

    .venv/bin/python bench/serving.py [--schedules tp,dtp:1,dtp:2,pt:2,spd:1,ladder] [--repeats 5]
        [--prompt 64 --tokens 32 --batch 4] [--layers 4 --hidden 512] [--out var/bench-serving.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.models.serving.vllm_kit import Server, export_tiny, vllm_missing


def _timed(server: Server, prompts: list[list[int]], tokens: int) -> float:
    t0 = time.perf_counter()
    server.complete(prompts, tokens)
    return time.perf_counter() - t0


def measure(server: Server, *, prompt: int, tokens: int, batch: int, repeats: int, seed: int) -> dict[str, Any]:
    import random

    rng = random.Random(seed)
    ids = [[rng.randrange(1, 250) for _ in range(prompt)] for _ in range(batch)]
    _timed(server, ids, tokens)  # warm-up
    ttft, decode, batch_tps = [], [], []
    for r in range(repeats):
        one = [[(t + r) % 250 + 1 for t in ids[0]]]  # a fresh prompt each repeat: no prefix-cache hit
        first = _timed(server, one, 1)
        full = _timed(server, one, tokens)
        ttft.append(first * 1e3)
        decode.append((tokens - 1) / max(full - first, 1e-9))
        fresh = [[(t + r + 1) % 250 + 1 for t in p] for p in ids]
        batch_tps.append(batch * tokens / _timed(server, fresh, tokens))

    def spread(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {"ttft_ms": spread(ttft), "decode_tps": spread(decode), "batch_tps": spread(batch_tps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default="tp,dtp:1,dtp:2,pt:2,spd:1,ladder")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    args = ap.parse_args()
    if (missing := vllm_missing()) is not None:
        print(f"bench/serving.py: {missing}", file=sys.stderr)
        return 2
    shape = dict(hidden_size=args.hidden, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                 head_dim=64, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers)
    schedules = [s for s in args.schedules.split(",") if s]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        engines = [("plain TP (vLLM's Llama)", schedules[0], "checkpoint")] + [(s, s, "shards") for s in schedules]
        exported: dict[str, Path] = {}
        for label, schedule, path in engines:
            if schedule not in exported:
                exported[schedule] = export_tiny(Path(tmp) / schedule.replace(":", "_").replace(",", "-"),
                                                 case="llama", schedule=schedule, shape=shape)
            server = Server(exported[schedule] / path, max_model_len=args.prompt + args.tokens + 8,
                            extra=["--no-enable-prefix-caching"])
            try:
                row = {"engine": label, "load": path, "start_s": server.start_s,
                       **measure(server, prompt=args.prompt, tokens=args.tokens, batch=args.batch,
                                 repeats=args.repeats, seed=0)}
            finally:
                server.stop()
            results.append(row)
            print(f"{label:26s} start {row['start_s']:6.1f} s | TTFT {row['ttft_ms']['median']:8.1f} ms "
                  f"({row['ttft_ms']['min']:.1f}..{row['ttft_ms']['max']:.1f}) | decode "
                  f"{row['decode_tps']['median']:7.1f} tok/s ({row['decode_tps']['min']:.1f}.."
                  f"{row['decode_tps']['max']:.1f}) | batch {args.batch} {row['batch_tps']['median']:7.1f} tok/s "
                  f"({row['batch_tps']['min']:.1f}..{row['batch_tps']['max']:.1f})", flush=True)
    report = {"shape": shape, "prompt": args.prompt, "tokens": args.tokens, "batch": args.batch,
              "repeats": args.repeats, "tp": 2, "dtype": "float32", "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
