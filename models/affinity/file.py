"""The affinity pass's result and its file (`affinity.safetensors`), without torch.

Raw per-token means, not normalised: up_fo / up_add [G, I] per layer (the FO and ADD up-edge scores of
§3) and down [I, G] per layer < N-1 — the paper's chain, the edges of dtp:1 — and, for a pass run for
another schedule (issue 20), the FO and ADD scores of every further edge (m, t) of that schedule
(`edges`, tensors `edge.M.T.fo` / `edge.M.T.add`, or `….rows` / `….cols` / `….values` for a neuron →
neuron edge kept sparse; files written before issue 29 hold `….indices` / `….values` top-k rows, read as
sparse). The metadata `schedule` names the schedule the pass was run for and `edges` lists the further
edges; a file without them (written before schedules) holds dtp:1. Read and written through safetensors'
numpy API, so the `score` command and the API process can load an affinity without
importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from models.affinity.edge_memory import further_pairs
from models.affinity.names import SCORES
from models.base.shapes import ModelShape
from models.io.atomic import atomic_write
from models.optimise.edges import (
    EdgeMatrix,
    Pair,
    ScheduleAffinity,
    SparseEdge,
    edge_name,
    schedule_pairs,
)
from models.schedules.grammar import Schedule

AFFINITY_FORMAT = "dtp-layout-affinity/1"
_OWN_METADATA = ("tokens", "format", "shape", "schedule", "edges")  # the file's own keys, not the run's


@dataclass
class AffinityResult:
    """Raw per-token means (not normalised): up_fo/up_add [G, I] per layer, down [I, G] per layer < N-1."""

    up_fo: list[np.ndarray]
    up_add: list[np.ndarray]
    down: list[np.ndarray]
    tokens: int
    shape: ModelShape
    metadata: dict[str, str] = field(default_factory=dict)
    schedule: str = "dtp:1"  # the schedule the pass was run for
    edges: dict[Pair, dict[str, EdgeMatrix]] = field(default_factory=dict)  # beyond the chain: {"fo", "add"}
    # (score, schedule) -> its ScheduleAffinity, built once so that its normalisation and bound are cached
    _schedule_affinities: dict[tuple[str, str], ScheduleAffinity] = field(default_factory=dict, repr=False,
                                                                           compare=False)

    def up(self, score: str) -> list[np.ndarray]:
        if score not in SCORES:
            raise ValueError(f"score must be one of {', '.join(SCORES)}, got {score!r}")
        return self.up_fo if score == "fo" else self.up_add

    def missing_edges(self, schedule: Schedule) -> list[Pair]:
        """The edges of `schedule` this file does not hold (the chain's it always holds)."""
        return [p for p in self.missing_edges_of(self.shape, schedule) if p not in self.edges]

    @staticmethod
    def missing_edges_of(shape: ModelShape, schedule: Schedule) -> list[Pair]:
        """The edges of `schedule` beyond the paper's chain (what the affinity pass scores on top of it)."""
        return further_pairs(schedule, shape.num_layers)

    def schedule_affinity(self, score: str, schedule: Schedule) -> ScheduleAffinity:
        """The matrices of `schedule`'s edges in `score` units; ValueError naming the missing edges when
        the pass was run for a schedule without them."""
        key = (score, f"{schedule}/{schedule.devices}")
        if key in self._schedule_affinities:
            return self._schedule_affinities[key]
        up = self.up(score)
        missing = self.missing_edges(schedule)
        if missing:
            names = ", ".join(edge_name(p) for p in missing[:6]) + (" …" if len(missing) > 6 else "")
            raise ValueError(f"the affinity was computed for schedule {self.schedule}; schedule {schedule} also "
                             f"needs the edges {names}: rerun the affinity pass with schedule {schedule}")
        matrices: dict[Pair, EdgeMatrix] = {}
        for m, t in schedule_pairs(schedule):
            if t == m + 1:
                matrices[(m, t)] = up[m // 2] if m % 2 == 0 else self.down[m // 2]
            else:
                matrices[(m, t)] = self.edges[(m, t)][score]
        affinity = ScheduleAffinity(str(schedule), self.shape.num_layers, self.shape.num_kv_groups,
                                    self.shape.intermediate_size, matrices, experts=self.shape.num_experts)
        self._schedule_affinities[key] = affinity
        return affinity

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, np.ndarray] = {}
        for prefix, mats in (("up_fo", self.up_fo), ("up_add", self.up_add), ("down", self.down)):
            for i, m in enumerate(mats):
                tensors[f"{prefix}.{i}"] = np.ascontiguousarray(m)
        listed = []
        for (sender, receiver), scores in sorted(self.edges.items()):
            entry: dict[str, object] = {"from": sender, "to": receiver}
            for name, matrix in scores.items():
                key = f"edge.{sender}.{receiver}.{name}"
                if isinstance(matrix, SparseEdge):
                    for part in ("rows", "cols", "values"):
                        tensors[f"{key}.{part}"] = np.ascontiguousarray(getattr(matrix, part))
                    entry[name] = {"sparse": list(matrix.shape), "total": matrix.total,
                                   "kept_mass": matrix.kept_mass}
                else:
                    tensors[key] = np.ascontiguousarray(matrix)
                    entry[name] = "dense"
            listed.append(entry)
        meta = {**self.metadata, "tokens": str(self.tokens), "format": AFFINITY_FORMAT,
                "shape": json.dumps(self.shape.__dict__), "schedule": self.schedule, "edges": json.dumps(listed)}
        atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))

    @classmethod
    def load(cls, path: str | Path) -> AffinityResult:
        path = Path(path)
        try:
            with safe_open(str(path), framework="np") as f:
                meta = dict(f.metadata() or {})
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        except Exception as exc:  # safetensors raises its own error type for malformed headers
            raise ValueError(f"{path}: cannot read affinity safetensors: {exc}") from exc
        if meta.get("format") != AFFINITY_FORMAT or "shape" not in meta:
            raise ValueError(f"{path}: not a dtp-layout affinity file (metadata format/shape missing)")
        try:
            shape = ModelShape(**json.loads(meta["shape"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed shape metadata: {exc}") from exc
        n = shape.num_layers

        def stack(prefix: str, count: int) -> list[np.ndarray]:
            try:
                return [np.asarray(tensors[f"{prefix}.{i}"], dtype=np.float64) for i in range(count)]
            except KeyError as exc:
                raise ValueError(f"{path}: missing tensor {exc.args[0]}") from exc

        edges = _read_edges(path, meta.get("edges", "[]"), tensors)
        return cls(stack("up_fo", n), stack("up_add", n), stack("down", n - 1), int(meta.get("tokens", 0)),
                   shape, {k: v for k, v in meta.items() if k not in _OWN_METADATA},
                   schedule=meta.get("schedule", "dtp:1"), edges=edges)


def _read_edges(path: Path, listed: str, tensors: dict[str, np.ndarray]) -> dict[Pair, dict[str, EdgeMatrix]]:
    """The further edges named in the metadata `edges`, from their tensors."""
    try:
        entries = json.loads(listed)
        edges: dict[Pair, dict[str, EdgeMatrix]] = {}
        for entry in entries:
            m, t = int(entry["from"]), int(entry["to"])
            scores: dict[str, EdgeMatrix] = {}
            for name in SCORES:
                key, how = f"edge.{m}.{t}.{name}", entry[name]
                if how == "dense":
                    scores[name] = np.asarray(tensors[key], dtype=np.float64)
                elif "sparse" in how:
                    rows, cols = how["sparse"]
                    scores[name] = SparseEdge(np.asarray(tensors[f"{key}.rows"], dtype=np.int32),
                                              np.asarray(tensors[f"{key}.cols"], dtype=np.int32),
                                              np.asarray(tensors[f"{key}.values"], dtype=np.float64),
                                              (int(rows), int(cols)), float(how["total"]))
                else:  # top-k rows, before issue 29
                    scores[name] = SparseEdge.from_rows(tensors[f"{key}.indices"], tensors[f"{key}.values"],
                                                        int(how["columns"]), float(how["total"]))
            edges[(m, t)] = scores
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed schedule edges (metadata 'edges' or their tensors): {exc!r}") from exc
    return edges
