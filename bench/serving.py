"""vLLM serving: decode tokens/s of one sequence, plain vLLM TP against the DTP plugin's schedules, at emulated
link latencies (issues 28, 42).

One random fp32 llama (by default 8 layers, hidden 768, head_dim 64) exported once per schedule at L = 2.
Each engine is `vllm.LLM` in the vLLM tests' engine host (tests/models/serving/vllm_host.py: .venv-vllm, TP = 2,
eager, prefix caching off; the same plugin, executor and TP workers as `vllm serve`, without the HTTP
server), loaded once: plain TP is vLLM's own Llama on the permuted checkpoint/, every schedule the plugin on
its shards/. Within one load the plugin's settings are switched in every TP worker (`LLM.collective_rpc`),
so each repeat runs every (link latency, exchange mode) in turn: interleaved. Engines run one at a time;
with --rounds R every engine is loaded R times, in turn (the order reversed every other round), and the
medians pool the R x repeats samples.

    decode_tps  one prompt of PROMPT tokens, (N-1) tokens over (t_N - t_1): a N-token and a 1-token
                completion timed inside the host (LLM.generate alone)
    ttft_ms     the 1-token completion (prefill + the first token)

The link latency (`link_latency_us`, models/serving/vllm/options.py) delays when each of the schedule's
exchanges (and the final average) is usable; plain vLLM has no such setting and runs at 0 µs only. TP =
the plugin's tp (vLLM's all-reduce at every module, each one waited at once), the baseline of the ratios.
A schedule whose every exchange is waited at once (tp, pt:D) runs the same code in both modes: measured once.

    .venv/bin/python bench/serving.py [--schedules tp,dtp:1,dtp:2,pt:2,ladder] [--latencies 0,100,500,2000]
        [--modes eager,overlap] [--repeats 5] [--rounds 1] [--prompt 16 --tokens 32] [--layers 8 --hidden 768]
        [--out docs/serving_latency.json] [--plot docs/serving_latency.png]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.models.serving.vllm_kit import EngineHost, HostedEngine, export_tiny, vllm_missing

PLAIN = "vLLM Llama"


def _cell(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _delays_exchanges(schedule: str, layers: int) -> bool:
    """Whether some exchange of the schedule is waited modules after it is sent (the modes differ only then)."""
    from models.runtime.arrivals import ArrivalPlan
    from models.schedules.grammar import resolve_schedule

    plan = ArrivalPlan.of(resolve_schedule(schedule, layers, 2, "sqrt"))
    return any(sent is not None and sent != n + 1 for n, sent in enumerate(plan.sends))


def _same_priority(pid: int) -> None:
    """Under `nice -n -5`, the engine host's session (a scheduling group of its own under Linux's autogroups)
    at this process's nice too; tests' `share_priority` does it only for positive nice values."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    if nice < 0:
        try:
            with open(f"/proc/{pid}/autogroup", "w") as group:
                group.write(str(nice))
        except OSError as exc:  # no autogroups, or not allowed: say so, the run goes on
            print(f"bench/serving.py: the engine host's autogroup stays at nice 0 ({exc})", file=sys.stderr)


def _one(engine: HostedEngine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(decode tok/s, first-token ms) of one sequence."""
    engine.complete([prompt], 1)
    first = engine.elapsed_s
    engine.complete([prompt], tokens)
    return (tokens - 1) / max(engine.elapsed_s - first, 1e-9), first * 1e3


def measure(engine: HostedEngine, arms: list[tuple[str, float]], *, prompt: int, tokens: int, repeats: int,
            seed: int, dtp: bool) -> dict[tuple[str, float], dict[str, list[float]]]:
    """Per (mode, latency): the repeats' decode tok/s and TTFT, every arm once per repeat in turn."""
    rng = random.Random(seed)  # the round: fresh prompts each load
    ids = [rng.randrange(1, 250) for _ in range(prompt)]
    samples: dict[tuple[str, float], dict[str, list[float]]] = {a: {"decode_tps": [], "ttft_ms": []} for a in arms}
    for warm in arms[:1] if dtp else []:
        engine.configure(*warm)
    _one(engine, ids, tokens)  # warm-up
    for r in range(repeats):
        for mode, latency in arms:
            if dtp:
                engine.configure(mode, latency)
            fresh = [(t + r) % 250 + 1 for t in ids]  # a fresh prompt each repeat
            tps, ttft = _one(engine, fresh, tokens)
            samples[mode, latency]["decode_tps"].append(tps)
            samples[mode, latency]["ttft_ms"].append(ttft)
    return samples


def crossover(latencies: list[float], ratios: list[float]) -> float | None:
    """The latency above which the ratio to TP exceeds 1 (linear between the measured ones): 0 if it does at
    the first, None if it never does."""
    if ratios[0] > 1.0:
        return latencies[0]
    for (l0, r0), (l1, r1) in itertools.pairwise(zip(latencies, ratios, strict=True)):
        if r0 <= 1.0 < r1:
            return l0 + (1.0 - r0) * (l1 - l0) / (r1 - r0)
    return None


def summarise(rows: list[dict[str, Any]], latencies: list[float]) -> dict[str, Any]:
    """Ratios of each (schedule, mode) to the plugin's tp at each latency, and the crossovers."""
    tp = {row["latency_us"]: row["decode_tps"]["median"] for row in rows if row["engine"] == "tp"}
    out: dict[str, Any] = {}
    for row in rows:
        base = tp.get(row["latency_us"])
        row["ratio_to_tp"] = row["decode_tps"]["median"] / base if base else None
    arms = sorted({(r["engine"], r["mode"]) for r in rows if r["engine"] not in ("tp", PLAIN)})
    for engine, mode in arms:
        by = {r["latency_us"]: r for r in rows if (r["engine"], r["mode"]) == (engine, mode)}
        ratios = [by[lat]["ratio_to_tp"] for lat in latencies if lat in by]
        if len(ratios) == len(latencies):
            out[f"{engine} {mode}"] = crossover(latencies, ratios)
    return out


def plot(rows: list[dict[str, Any]], latencies: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    xs = list(range(len(latencies)))
    for engine, mode in sorted({(r["engine"], r["mode"]) for r in rows if r["engine"] != PLAIN}):
        by = {r["latency_us"]: r["decode_tps"] for r in rows if (r["engine"], r["mode"]) == (engine, mode)}
        med = [by[lat]["median"] for lat in latencies]
        err = [[by[lat]["median"] - by[lat]["min"] for lat in latencies],
               [by[lat]["max"] - by[lat]["median"] for lat in latencies]]
        ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, lw=2.2 if engine == "tp" else 1.2,
                    ls="-" if mode.startswith("eager") else "--", label=f"{engine} ({mode})")
    plain = [r["decode_tps"] for r in rows if r["engine"] == PLAIN]
    if plain:
        ax.plot([0], [plain[0]["median"]], "k*", ms=12, label="plain vLLM TP (0 µs only)")
    ax.set_xticks(xs, [f"{lat:g}" for lat in latencies])
    ax.set_xlabel("emulated link latency per exchange (µs)")
    ax.set_ylabel("decode tok/s, one sequence (median, min..max)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _print_row(row: dict[str, Any]) -> None:
    d, t = row["decode_tps"], row["ttft_ms"]
    print(f"{row['engine']:12s} {row['mode']:14s} {row['latency_us']:6g} µs | decode {d['median']:7.1f} tok/s "
          f"({d['min']:.1f}..{d['max']:.1f}) | TTFT {t['median']:7.1f} ms", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", default="tp,dtp:1,dtp:2,pt:2,ladder")
    ap.add_argument("--latencies", default="0,100,500,2000", help="emulated link latencies, µs")
    ap.add_argument("--modes", default="eager,overlap")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per engine load")
    ap.add_argument("--rounds", type=int, default=1, help="loads of every engine, in turn (repeats x rounds samples)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--no-plain", action="store_true", help="skip plain vLLM TP")
    ap.add_argument("--out", default=None, help="write the results as JSON here too")
    ap.add_argument("--plot", default=None, help="write the plot (PNG) here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the engine host is stopped on the way out
    if (missing := vllm_missing()) is not None:
        print(f"bench/serving.py: {missing}", file=sys.stderr)
        return 2
    shape = dict(hidden_size=args.hidden, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                 head_dim=64, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers)
    schedules = [s for s in args.schedules.split(",") if s]
    latencies = [float(x) for x in args.latencies.split(",") if x]
    modes = [m for m in args.modes.split(",") if m]
    load = os.getloadavg()
    t_start = time.time()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        host = EngineHost(Path(tmp) / "host.log")
        _same_priority(host.proc.pid)
        try:
            engines = ([] if args.no_plain else [(PLAIN, schedules[0], "checkpoint")]) + \
                [(s, s, "shards") for s in schedules]
            exported = {s: export_tiny(Path(tmp) / s.replace(":", "_"), case="llama", schedule=s, shape=shape)
                        for s in schedules}
            pooled: dict[tuple[str, str, float], dict[str, list[float]]] = {}
            starts: dict[str, list[float]] = {}
            for r in range(args.rounds):  # every engine once a round, the order reversed every other round
                for label, schedule, path in engines if r % 2 == 0 else engines[::-1]:
                    dtp = path == "shards"
                    both = dtp and _delays_exchanges(schedule, args.layers)
                    arms = [(m, lat) for lat in latencies for m in (modes if both else modes[:1])] if dtp else \
                        [(modes[0], 0.0)]
                    engine = host.load(exported[schedule] / path, max_model_len=args.prompt + args.tokens + 8,
                                       max_num_batched_tokens=max(64, args.prompt),
                                       engine_args={"enable_prefix_caching": False})
                    starts.setdefault(label, []).append(engine.start_s)
                    try:
                        samples = measure(engine, arms, prompt=args.prompt, tokens=args.tokens,
                                          repeats=args.repeats, seed=r, dtp=dtp)
                    finally:
                        engine.stop()
                    for (mode, latency), got in samples.items():
                        shown = mode if both else ("-" if not dtp else f"{mode} = overlap")
                        cell = pooled.setdefault((label, shown, latency), {"decode_tps": [], "ttft_ms": []})
                        for key in cell:
                            cell[key] += got[key]
                        _print_row({"engine": label, "mode": shown, "latency_us": latency,
                                    "decode_tps": _cell(got["decode_tps"]), "ttft_ms": _cell(got["ttft_ms"])})
            for (label, shown, latency), got in pooled.items():
                rows.append({"engine": label, "mode": shown, "latency_us": latency, "start_s": starts[label],
                             "decode_tps": _cell(got["decode_tps"]), "ttft_ms": _cell(got["ttft_ms"]),
                             "samples": got})
        finally:
            host.stop()
    crossovers = summarise(rows, latencies)
    report = {"shape": shape, "prompt": args.prompt, "tokens": args.tokens, "repeats": args.repeats,
              "rounds": args.rounds, "tp": 2,
              "dtype": "float32", "latencies_us": latencies, "modes": modes, "rows": rows,
              "crossover_us": crossovers, "load_before": load, "load_after": os.getloadavg(),
              "wall_s": time.time() - t_start, "cpus": os.cpu_count(),
              "binding": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0|1 (vllm_kit.cpu_env)"),
              "command": " ".join(sys.argv)}
    print("\npooled over the rounds:")
    for row in rows:
        _print_row(row)
    print("\nratio to the plugin's tp at each latency:")
    for row in rows:
        if row["ratio_to_tp"] is not None:
            print(f"  {row['engine']:12s} {row['mode']:14s} {row['latency_us']:6g} µs  {row['ratio_to_tp']:.2f}")
    print("crossover (µs; None: not above tp up to the largest latency):", json.dumps(crossovers))
    print(f"load average before {load}, after {report['load_after']}; {report['wall_s']:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(rows, latencies, Path(args.plot), f"vLLM CPU, TP=2, fp32 llama {args.layers}×{args.hidden}, one sequence "
             f"(median of {args.repeats * args.rounds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
