"""What the pass over the edges a schedule adds beyond the paper's chain holds (`models.affinity.edges.edge_pass`),
counted from the model's shape alone.

Torch-free (the API process imports it): the edge pass splits its edges into rounds by this arithmetic, and the
run's memory rules (models/run/rules.py `memory_refusals`) refuse, before any weight is read, a schedule whose
pass would not fit the run's memory limit beside the model in memory (issue 46: one neuron → neuron edge of a
Qwen3-30B-A3B-shaped MoE, I = 128 × 768 = 98,304 units, holds 5 float64 [I, I] matrices, ~386 GB).

Per edge (m, t), U_m × U_t units (an attention's units its G KV groups, an FFN's its I neurons; H query heads of
head dim hd; E the FFN's experts, 1 dense):

    KV group → neuron     float64 sums [H, I] ×2 and [I]                          (the up score's)
    neuron → KV group     [I]
    KV group → KV group   [H, hd, hd]
    neuron → neuron       [I, I] ×3 and [I, E], and its dense FO and ADD [I, I] ×2 while it is finalised

The pass's peak, beyond the model and its micro-batch: one round's accumulators (the edges of a round fit the
edge memory limit together; an edge above it has a round of its own) plus the finished edges kept from the rounds
before (at most their dense size, and at most the limit: above it the neuron → neuron edges are cut sparse). Not
counted: the transients of one edge at a time (a micro-batch's [I, I] products, M_g and M_u while finalising).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.base.shapes import ModelShape
from models.io.sizes import format_size
from models.optimise.edges import Pair, chain_pairs, edge_kind, schedule_pairs
from models.schedules.grammar import Schedule

F64 = 8  # bytes of a float64 accumulator or score
# SmolLM2-135M on 256 corpus tokens needs 8–49 % of a neuron → neuron FO matrix's entries (43–58 % of an
# ADD one) for 95 % of its mass, so 1 GiB (its dtp:2 edges dense: 1.02 GiB) keeps ≥ 95 % where 256 MiB could not.
EDGE_MEMORY_LIMIT = 1 << 30

KIND_NAMES = {"up": "KV group → neuron", "down": "neuron → KV group", "kv-kv": "KV group → KV group",
              "neuron-neuron": "neuron → neuron"}


def further_pairs(schedule: Schedule, num_layers: int) -> list[Pair]:
    """The edges of `schedule`'s J_σ beyond the paper's chain: what the edge pass scores."""
    chain = set(chain_pairs(num_layers))
    return [p for p in schedule_pairs(schedule) if p not in chain]


def edge_units(pair: Pair, shape: ModelShape) -> tuple[int, int]:
    """(U_m, U_t): the sending and receiving module's units (KV groups of an attention, neurons of an FFN)."""
    def units(n: int) -> int:
        return shape.num_kv_groups if n % 2 == 0 else shape.intermediate_size

    return units(pair[0]), units(pair[1])


def dense_edge_bytes(pair: Pair, shape: ModelShape) -> int:
    """The finished scores of one edge, dense float64 (FO and ADD; one matrix where they are one score)."""
    G, I = shape.num_kv_groups, shape.intermediate_size
    return {"up": 2 * G * I, "down": I * G, "kv-kv": G * G}.get(edge_kind(pair), 2 * I * I) * F64


def accumulator_bytes(pair: Pair, shape: ModelShape) -> int:
    """What one edge holds during the pass: its float64 sums over tokens, and for a neuron → neuron edge
    also its dense FO and ADD while they are finalised (then kept, or cut to a sparse edge)."""
    H, hd, I = shape.num_query_heads, shape.head_dim, shape.intermediate_size
    kind = edge_kind(pair)
    if kind == "up":
        return (2 * H * I + I) * F64
    if kind == "down":
        return I * F64
    if kind == "kv-kv":
        return H * hd * hd * F64
    return (3 * I * I + I * shape.neuron_blocks) * F64 + dense_edge_bytes(pair, shape)


def edge_rounds(pairs: list[Pair], shape: ModelShape, memory_limit: int) -> list[list[Pair]]:
    """The edges split into passes over the calibration blocks whose accumulators fit `memory_limit`
    together (an edge larger than the limit alone gets a pass of its own). Each pass after the first is
    one more no-grad forward over the blocks: memory bought with compute (SmolLM2-135M `dtp:2`: 29
    neuron → neuron pairs of ~94 MB each take 15 passes under 256 MiB, 3 under the default 1 GiB)."""
    rounds: list[list[Pair]] = []
    used = 0
    for pair in pairs:
        need = accumulator_bytes(pair, shape)
        if not rounds or used + need > memory_limit:
            rounds.append([])
            used = 0
        rounds[-1].append(pair)
        used += need
    return rounds


@dataclass(frozen=True)
class EdgePassMemory:
    """The edge pass's peak (`peak` = `accumulators` + `kept`, at its fullest round) and its largest edge."""

    edges: int  # the further edges scored
    rounds: int  # passes over the calibration blocks
    peak: int  # bytes
    accumulators: int  # the fullest round's accumulators
    kept: int  # the finished edges kept from the rounds before it
    largest: Pair
    largest_bytes: int  # its accumulators
    largest_units: tuple[int, int]  # (U_m, U_t)

    def largest_text(self) -> str:
        """'one neuron → neuron edge of 98,304 × 98,304 units: 359.49 GiB of …'."""
        kind = edge_kind(self.largest)
        what = ("float64 sums and its dense FO and ADD while it is finalised" if kind == "neuron-neuron"
                else "float64 sums")
        rows, cols = self.largest_units
        return f"one {KIND_NAMES[kind]} edge of {rows:,} × {cols:,} units: {format_size(self.largest_bytes)} of {what}"

    def describe(self) -> str:
        """'94 edges in 94 passes over the calibration blocks: one pass's accumulators … + … finished edges kept'."""
        return (f"{self.edges} edges in {self.rounds} pass{'es' if self.rounds != 1 else ''} over the calibration "
                f"blocks: one pass's accumulators {format_size(self.accumulators)} + finished edges kept "
                f"{format_size(self.kept)}")


def edge_pass_memory(pairs: list[Pair], shape: ModelShape, memory_limit: int = EDGE_MEMORY_LIMIT
                     ) -> EdgePassMemory | None:
    """What `edge_pass` over `pairs` holds at its peak under its `memory_limit` (None: no pairs, no pass)."""
    pairs = sorted(set(pairs))  # the pass's own order
    if not pairs:
        return None
    best = (-1, 0, 0)  # (peak, accumulators, kept)
    finished = 0  # dense bytes of the rounds done
    rounds = edge_rounds(pairs, shape, memory_limit)
    for round_pairs in rounds:
        accumulators = sum(accumulator_bytes(p, shape) for p in round_pairs)
        kept = min(finished, memory_limit)
        best = max(best, (accumulators + kept, accumulators, kept))
        finished += sum(dense_edge_bytes(p, shape) for p in round_pairs)
    largest = max(pairs, key=lambda p: accumulator_bytes(p, shape))
    return EdgePassMemory(edges=len(pairs), rounds=len(rounds), peak=best[0], accumulators=best[1], kept=best[2],
                          largest=largest, largest_bytes=accumulator_bytes(largest, shape),
                          largest_units=edge_units(largest, shape))
