"""Writes layouts_fixture.npz: the optimiser's inputs and the layouts it returned before issue 27.

The chain optimiser (dtp:1) and the schedule optimiser were two implementations until issue 27 made them
one. This script ran on the two implementations (at commit 126e2eb, `optimise` for the chain cases and
`optimise_schedule` for the schedule cases) and recorded their exact layouts (and sweeps, J, per-edge
fractions, bound) on seeded random affinities, a planted-structure affinity and a tiny real model's
affinity pass; `test_layouts_fixture.py` asserts the one optimiser returns the same. The inputs are stored
too, so the test needs neither torch nor these generators. Rerun only to add cases, never to "fix" a failure:

    PYTHONPATH=. .venv/bin/python tests/models/optimise/make_layouts_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

FIXTURE = Path(__file__).with_name("layouts_fixture.npz")

# The chain cases: (affinity name, devices, options of `optimise`).
CHAIN_OPTIONS: list[dict[str, Any]] = [
    {},
    {"restarts": 3},
    {"restarts": 2, "seed": 5},
    {"maximise": False},
    {"maximise": False, "restarts": 2},
    {"move_heads": False},
    {"move_neurons": False},
    {"move_neurons": False, "restarts": 2},
    {"layers": [0, 2]},
]
SCHEDULES = ["dtp:2", "dtp:3", "dtp:1@2", "dtp:2@2", "spd:1", "spd:0,2", "pt:1", "pt:2"]


def chain_affinities() -> dict[str, tuple[Any, list[int]]]:
    """name -> (Affinity, device counts)."""
    from bench.optimiser import synthetic_affinity
    from models.affinity.scoring import affinity_pass
    from models.variants.set import affinity_for
    from tests.models.optimise.kit import affinity_of
    from tests.tiny import tiny_model, tokens

    out: dict[str, tuple[Any, list[int]]] = {
        "random-4x8x64": (affinity_of(4, 8, 64, seed=0), [2, 4]),
        "random-3x6x24": (affinity_of(3, 6, 24, seed=1), [3]),
        "random-3x8x48": (affinity_of(3, 8, 48, seed=2), [2]),
        "zero-edges-3x4x16": (affinity_of(3, 4, 16, seed=6, zero_edges=("up1", "down0")), [2]),
        "planted-6x8x64": (synthetic_affinity(6, 8, 64, 4, seed=3), [4]),
    }
    result = affinity_pass(tiny_model("llama"), tokens(batch=4, seq=32), batch_size=2)
    for score_name in ("fo", "add"):
        out[f"tiny-llama-{score_name}"] = (affinity_for(result, score_name), [2, 4])
    return out


def schedule_affinities() -> dict[str, Any]:
    from models.optimise.edges import ScheduleAffinity, SparseEdge, schedule_pairs
    from models.schedules.grammar import resolve_schedule

    layers, groups, neurons, devices = 3, 4, 8, 2
    rng = np.random.default_rng(20)
    units = [groups if n % 2 == 0 else neurons for n in range(2 * layers)]
    full = {(m, t): rng.lognormal(0.0, 1.5, (units[m], units[t]))
            for m in range(2 * layers) for t in range(m + 1, 2 * layers)}
    out = {}
    for name in SCHEDULES:
        pairs = schedule_pairs(resolve_schedule(name, layers, devices))
        out[name] = ScheduleAffinity(name, layers, groups, neurons, {p: full[p] for p in pairs})
    dense = out["dtp:2"]
    out["dtp:2-top3"] = ScheduleAffinity("dtp:2", layers, groups, neurons,
                                         {p: SparseEdge.top_k(m, 3) if p[0] % 2 and p[1] % 2 else m
                                          for p, m in dense.edges.items()})
    return out


def record(arrays: dict[str, np.ndarray], key: str, result: Any) -> dict[str, Any]:
    arrays[f"{key}/heads"] = np.asarray(result.kv_group_device)
    arrays[f"{key}/cells"] = np.asarray(result.neuron_device)
    rep = result.report
    return {"sweeps": result.sweeps, "history": list(result.history), "J": rep.J,
            "random_expectation": rep.random_expectation, "upper_bound": rep.upper_bound,
            "upper_bound_exact": rep.upper_bound_exact, "up_fraction": list(rep.up_fraction),
            "down_fraction": list(rep.down_fraction)}


def main() -> None:
    from models.optimise import optimise
    from models.optimise.edges import SparseEdge

    arrays: dict[str, np.ndarray] = {}
    cases: list[dict[str, Any]] = []
    for name, (affinity, device_counts) in chain_affinities().items():
        for i, matrix in enumerate(affinity.up):
            arrays[f"{name}/up{i}"] = np.asarray(matrix)
        for i, matrix in enumerate(affinity.down):
            arrays[f"{name}/down{i}"] = np.asarray(matrix)
        for devices in device_counts:
            for k, options in enumerate(CHAIN_OPTIONS):
                key = f"chain/{name}/L{devices}/{k}"
                expected = record(arrays, key, optimise(affinity, devices, **options))
                cases.append({"kind": "chain", "key": key, "affinity": name, "num_layers": affinity.num_layers,
                              "devices": devices, "options": options, **expected})
    for name, sigma in schedule_affinities().items():
        edges = []
        for (m, t), matrix in sigma.edges.items():
            if isinstance(matrix, SparseEdge):  # top-k rows: k entries a row, in row order
                arrays[f"{name}/{m}-{t}/indices"] = matrix.cols.reshape(matrix.shape[0], -1)
                arrays[f"{name}/{m}-{t}/values"] = matrix.values.reshape(matrix.shape[0], -1)
                edges.append({"pair": [m, t], "top_rows": True, "columns": matrix.shape[1], "total": matrix.total})
            else:
                arrays[f"{name}/{m}-{t}"] = np.asarray(matrix)
                edges.append({"pair": [m, t], "top_rows": False})
        for k, options in enumerate(CHAIN_OPTIONS[:5]):
            key = f"schedule/{name}/L2/{k}"
            expected = record(arrays, key, optimise(sigma, 2, **options))
            cases.append({"kind": "schedule", "key": key, "affinity": name, "schedule": sigma.schedule,
                          "num_layers": sigma.num_layers, "num_kv_groups": sigma.num_kv_groups,
                          "intermediate_size": sigma.intermediate_size, "edges": edges, "devices": 2,
                          "options": options, **expected})
    arrays["cases"] = np.array(json.dumps(cases))
    np.savez_compressed(FIXTURE, **arrays)
    print(f"{FIXTURE}: {len(cases)} cases, {FIXTURE.stat().st_size} bytes")


if __name__ == "__main__":
    main()
