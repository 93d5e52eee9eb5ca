"""Blocked time per token under each communication schedule, at emulated link latencies: the growth over
the 0-µs baseline is the link's share.

The multi-process runtime (`models.runtime`) on rank shards of a SmolLM2-135M-shaped random model
(random weights, the real shape: 30 layers, 9 query / 3 KV heads, FFN 1536, vocabulary 49152; for an
L that does not divide 3, the same width as 8 query / 4 KV heads of 72),
gloo, one torch thread per rank, each rank pinned to its own core (`os.sched_setaffinity`, every
thread of the process) so that no rank waits for a peer the OS descheduled in favour of another
rank. Each collective's result becomes usable X µs after it completed (`link_latency_us`). Every
schedule runs on the same shards (`schedule_override`: the timing does not depend on the weights),
interleaved with the others in every repeat so that machine noise hits them alike.

What is reported per schedule: the exchanges per token, decode ms/token and blocked ms/token at
0 µs, and at each X > 0 the growth of the blocked time over the schedule's own 0-µs figure, next
to what a schedule that hid nothing would pay, (syncs + 2)·X (the +2: the final reduction to rank
0 and the token broadcast, which every schedule waits for at once).

This is an emulation on CPU: gloo goes through the loopback interface and the latency is a sleep.
Run with ranks ≤ free cores (`--devices`, default 2 on the 2-core dev machine). On a machine with
one GPU per rank, run it with `--backend nccl`.

    .venv/bin/python bench/runtime.py [--layers 30 --devices 2 --prompt 16 --tokens 16 --repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.export.resident import export_rank_shards, permuted_copy
from models.families import model_shape
from models.layouts import layout as lay
from models.runtime import DTPRuntime
from models.schedules.grammar import resolve_schedule

# SmolLM2-135M's dimensions (HuggingFaceTB/SmolLM2-135M config).
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)
LATENCIES_US = (0.0, 500.0, 2000.0)


def default_schedules(layers: int) -> list[str]:
    """tp, dtp:1, dtp:2, ladder, SPD at every other layer, Parallel Track at 2 and 4 layers per block,
    and dtp:1 on the upper half."""
    return ["tp", "dtp:1", "dtp:2", "ladder", "spd:" + ",".join(map(str, range(1, layers, 2))), "pt:2", "pt:4",
            f"dtp:1@{max(1, layers // 2)}"]


# L = 2 (or 4) cannot split SmolLM2's 3 KV groups: the same width (576) as 8 query / 4 KV heads of 72.
EVEN_HEADS = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=72)


def smollm2_shaped(num_layers: int, devices: int, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    dims = SMOLLM2_135M if SMOLLM2_135M["num_key_value_heads"] % devices == 0 else {**SMOLLM2_135M, **EVEN_HEADS}
    config = AutoConfig.for_model("llama", num_hidden_layers=num_layers, **dims)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def pin_ranks(pids: list[int]) -> list[int]:
    """Rank r's every thread to core r of this process's allowed cores (threads started later inherit it)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(pids) > len(cores):
        raise SystemExit(f"{len(pids)} ranks but {len(cores)} cores: run at most one rank per core (--devices)")
    for rank, pid in enumerate(pids):
        for task in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(task), {cores[rank]})
    return cores[:len(pids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--devices", type=int, default=2, help="ranks, one per core (default: 2)")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=16, help="generated tokens per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--schedules", help="comma-separated list of schedules separated by ';' (default: a set of "
                                        "every preset)")
    ap.add_argument("--latencies", default=",".join(f"{x:g}" for x in LATENCIES_US), help="µs, comma-separated")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    ap.add_argument("--no-pin", action="store_true", help="leave the ranks to the OS scheduler")
    args = ap.parse_args()

    schedules = args.schedules.split(";") if args.schedules else default_schedules(args.layers)
    latencies = [float(x) for x in args.latencies.split(",")]
    if latencies[0] != 0.0:
        raise SystemExit("the first latency must be 0 (the baseline)")
    tables = {s: resolve_schedule(s, args.layers, args.devices) for s in schedules}
    model = smollm2_shaped(args.layers, args.devices)
    heads = f"{model.config.num_attention_heads} query / {model.config.num_key_value_heads} KV heads"
    layout = lay.random(model_shape(model.config), args.devices, 1, seed=1000)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    runs: dict[tuple[float, str], list[tuple[float, float]]] = {}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        shards = export_rank_shards(permuted_copy(model, layout), layout, Path(tmp) / "shards")
        del model
        with DTPRuntime.start(shards, backend=args.backend, threads=1, timeout_s=120.0) as rt:
            rt.generate(ids.numpy(), max_new_tokens=4, stop_at_eos=False)  # warm-up: gloo's threads exist now
            pinned = "unpinned" if args.no_pin else f"pinned to cores {pin_ranks(rt.pids)}"
            for _ in range(args.repeats):
                for latency in latencies:
                    for schedule in schedules:  # interleaved, so machine noise hits every schedule alike
                        out = rt.generate(ids.numpy(), max_new_tokens=args.tokens, schedule_override=schedule,
                                          stop_at_eos=False, link_latency_us=latency)
                        ms = max(r.ms_per_token for r in out.ranks if r.ms_per_token is not None)
                        blocked = statistics.mean(r.blocked_ms_per_token or 0.0 for r in out.ranks)
                        runs.setdefault((latency, schedule), []).append((ms, blocked))
                load.append(os.getloadavg()[0])

    def median(latency: float, schedule: str, k: int) -> float:
        return statistics.median(r[k] for r in runs[(latency, schedule)])

    def growths(latency: float, schedule: str) -> list[float]:
        """Per repeat, the blocked ms/token at `latency` minus the same repeat's at 0 µs (paired: the two ran
        minutes apart in the same interleaved sweep, so the slow drift of the machine cancels)."""
        return [a[1] - b[1] for a, b in zip(runs[(latency, schedule)], runs[(0.0, schedule)], strict=True)]

    print(f"SmolLM2-135M-shaped (random weights, {heads}), {args.layers} layers, L={args.devices} ranks {pinned}, "
          f"{args.backend}, 1 thread/rank, fp32 CPU, prompt {args.prompt}, {args.tokens} tokens, median of "
          f"{args.repeats}; load average {min(load):.1f}–{max(load):.1f} (a shared machine)")
    head = f"{'schedule':<14}{'syncs':>6}{'ms/tok@0':>10}{'blocked@0':>10}"
    head += "".join(f"{f'+blocked@{x:g}µs [min–max] (exposed)':>42}" for x in latencies[1:])
    print(head)
    tp_ms = median(0.0, schedules[0], 0)
    for s in schedules:
        syncs = tables[s].syncs_per_token
        row = f"{s:<14}{syncs:>6}{median(0.0, s, 0):>10.1f}{median(0.0, s, 1):>10.1f}"
        for x in latencies[1:]:
            g = growths(x, s)
            row += f"{statistics.median(g):>16.1f} [{min(g):6.1f}–{max(g):6.1f}] ({(syncs + 2) * x / 1e3:6.1f})"
        print(row)
    print(f"ms/token at 0 µs relative to {schedules[0]}: "
          + ", ".join(f"{s} {median(0.0, s, 0) / tp_ms:.2f}" for s in schedules[1:]))
    print("+blocked@X: per repeat, blocked ms/token at X minus the same schedule's at 0 µs (mean over ranks); "
          "the median and [min–max] over repeats; exposed: (syncs + 2)·X, what waiting for every exchange at "
          "once would add. The 0-µs columns are this machine's compute and loopback costs, not a link's: they "
          "order schedules by how much work each token does here, nothing more")
    x = latencies[-1]
    for line in resolved_order({s: growths(x, s) for s in schedules}):
        print(f"@{x:g}µs {line}")


def resolved_order(growth: dict[str, list[float]]) -> list[str]:
    """Schedules by median growth, each neighbouring pair marked resolved ('<') when every repeat of the
    first grew less than every repeat of the second, else unresolved ('≈'): the only differences the
    spread lets one call."""
    ranked = sorted(growth, key=lambda s: statistics.median(growth[s]))
    text = ranked[0]
    for a, b in itertools.pairwise(ranked):
        text += (" < " if max(growth[a]) < min(growth[b]) else " ≈ ") + b
    return [f"growth order (< resolved by every repeat, ≈ within the spread): {text}"]


if __name__ == "__main__":  # the ranks' forkserver (or spawn) imports this module too
    main()
