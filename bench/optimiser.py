"""Affinity optimiser wall time on Qwen3-0.6B dimensions with heavy-tailed synthetic affinities.

N=28 layers, G=8 KV groups, I=3072 neurons, L=4 devices. Each affinity matrix is lognormal noise with
dominant group↔neuron blocks (see `synthetic_affinity`), so there is structure for the optimiser to find.
Target: well under a second on 2 CPU cores.

    .venv/bin/python bench/optimiser.py [--layers 28 --groups 8 --neurons 3072 --devices 4 --seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.optimise import Affinity, contiguous_layout, contiguous_row, optimise, score, upper_bound

T = TypeVar("T")


def synthetic_affinity(layers: int, groups: int, neurons: int, devices: int, seed: int = 0, sigma: float = 1.5,
                       boost: float = 4.0, agree: float = 0.7) -> Affinity:
    """Lognormal(0, sigma) noise times `boost` on dominant group↔neuron blocks.

    Each layer hides a random balanced partition of its KV groups into L blocks and each neuron leans
    on one block of its own layer (up) and, with probability `agree` the same-numbered one, of the next
    layer (down): the layout that puts block b and its neurons on one device is far from contiguous.
    """
    rng = np.random.default_rng(seed)
    hidden = [rng.permutation(contiguous_row(groups, devices)) for _ in range(layers)]  # [N][G] block of g
    up, down = [], []
    for i in range(layers):
        block = rng.integers(0, devices, neurons)  # [I] block neuron k leans on
        s_up = rng.lognormal(0.0, sigma, (groups, neurons))  # [G, I]
        s_up[hidden[i][:, None] == block[None, :]] *= boost
        up.append(s_up)
        if i + 1 < layers:
            next_block = np.where(rng.random(neurons) < agree, block, rng.integers(0, devices, neurons))  # [I]
            s_down = rng.lognormal(0.0, sigma, (neurons, groups))  # [I, G]
            s_down[next_block[:, None] == hidden[i + 1][None, :]] *= boost
            down.append(s_down)
    return Affinity(up, down)


def timed(fn: Callable[[Affinity], T], make: Callable[[], Affinity], repeats: int) -> tuple[float, T]:
    """Median wall time of fn over `repeats` runs, each on a fresh affinity made outside the clock."""
    times = []
    for _ in range(repeats):
        affinity = make()
        t0 = time.perf_counter()
        result = fn(affinity)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--neurons", type=int, default=3072)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--restarts", type=int, default=4, help="extra random head starts (as `optimise` uses)")
    args = ap.parse_args()

    affinity = synthetic_affinity(args.layers, args.groups, args.neurons, args.devices, args.seed)

    def fresh() -> Affinity:
        # A new object each time so that no cached normalisation or bound carries over between runs.
        return Affinity(affinity.up, affinity.down)

    bound_time, bound = timed(lambda a: upper_bound(a, args.devices), fresh, args.repeats)
    opt_time, result = timed(lambda a: optimise(a, args.devices, bound=bound), fresh, args.repeats)
    full_time, _ = timed(lambda a: optimise(a, args.devices), fresh, args.repeats)
    restart_time, restarted = timed(lambda a: optimise(a, args.devices, restarts=args.restarts), fresh, args.repeats)
    contiguous = score(affinity, *contiguous_layout(affinity, args.devices), bound=bound)
    report = result.report

    print(f"Qwen3-0.6B dimensions: N={args.layers} layers, G={args.groups} KV groups, I={args.neurons} neurons, "
          f"L={args.devices}; lognormal affinities with dominant blocks, seed {args.seed}; "
          f"median of {args.repeats}")
    print(f"optimise, bound given     {opt_time * 1e3:8.1f} ms   ({result.sweeps} sweeps)")
    print(f"upper bound alone         {bound_time * 1e3:8.1f} ms")
    print(f"optimise, incl. bound     {full_time * 1e3:8.1f} ms")
    print(f"J optimised               {report.J:8.3f}   history {[round(j, 3) for j in result.history]}")
    print(f"J contiguous              {contiguous.J:8.3f}")
    print(f"random expectation        {report.random_expectation:8.3f}   (2N-1)/L")
    print(f"upper bound               {report.upper_bound:8.3f}   exact={report.upper_bound_exact}")
    print(f"J / upper bound           {report.J / report.upper_bound:8.3f}")
    ratio = restarted.report.J / restarted.report.upper_bound
    print(f"with {args.restarts} restarts        {restart_time * 1e3:8.1f} ms   incl. bound; "
          f"J {restarted.report.J:.3f}, J / upper bound {ratio:.3f}")
    heads, _ = contiguous_layout(affinity, args.devices)
    moved = int((result.kv_group_device != heads).any(axis=1).sum())
    print(f"layers whose heads moved  {moved:8d}   of {args.layers}")


if __name__ == "__main__":
    main()
