"""SparseEdge.keeping and the entry pool that shares the memory limit among neuron → neuron matrices (issue 29),
against literal loops over sorted entries."""

from __future__ import annotations

import numpy as np
import pytest

from models.affinity.edges import SPARSE_ENTRY, _EntryPool
from models.optimise.edges import SparseEdge


def literal_count(matrix: np.ndarray, mass: float) -> int:
    """The fewest largest entries whose sum reaches `mass` of the total, counted one by one."""
    total, running = float(matrix.sum()), 0.0
    for count, value in enumerate(sorted(matrix.ravel().tolist(), reverse=True), start=1):
        running += value
        if running >= mass * total:
            return count
    return matrix.size


@pytest.mark.parametrize("mass", [0.3, 0.9, 0.95, 1.0])
def test_keeping_takes_the_fewest_largest_entries_reaching_the_mass(mass: float) -> None:
    matrix = np.random.default_rng(4).lognormal(0.0, 2.0, (12, 20))
    kept = SparseEdge.keeping(matrix, mass)
    assert kept.values.size == literal_count(matrix, mass)
    assert kept.kept_mass >= mass - 1e-12 and kept.total == pytest.approx(matrix.sum(), rel=1e-12)
    np.testing.assert_array_equal(kept.values, matrix[kept.rows, kept.cols])
    rest = matrix.copy()
    rest[kept.rows, kept.cols] = -1.0
    assert kept.values.min() >= rest.max()
    np.testing.assert_array_equal(kept.dense()[kept.rows, kept.cols], kept.values)


def test_keeping_stops_at_max_entries_and_says_what_it_kept() -> None:
    matrix = np.random.default_rng(5).lognormal(0.0, 1.0, (10, 10))
    kept = SparseEdge.keeping(matrix, 0.95, max_entries=7)
    assert kept.values.size == 7
    assert kept.kept_mass == pytest.approx(sum(sorted(matrix.ravel().tolist())[-7:]) / matrix.sum(), rel=1e-12)


def test_the_pool_gives_what_one_matrix_leaves_to_the_later_ones() -> None:
    rng = np.random.default_rng(6)
    peaked = np.zeros((16, 16))
    peaked[np.arange(16), np.arange(16)] = 1.0  # 95 % of its mass in 16 of 256 entries
    diffuse = rng.uniform(1.0, 1.1, (32, 32))  # 95 % needs ~970 of 1024 entries
    pool = _EntryPool(entries=300, matrices=3)
    first = pool.store(peaked, 0.95)
    assert isinstance(first, SparseEdge) and first.values.size == literal_count(peaked, 0.95)
    # the second may take half of the 284 left (more than the first share of 100), and that is smaller
    # than dense (142 × 16 bytes against 1024 × 8)
    second = pool.store(diffuse, 0.95)
    assert isinstance(second, SparseEdge) and second.values.size == (300 - first.values.size) // 2
    third = pool.store(diffuse, 0.95)
    assert isinstance(third, SparseEdge) and third.values.size == 300 - first.values.size - second.values.size
    assert pool.left == 0
    roomy = _EntryPool(entries=10 * diffuse.nbytes // SPARSE_ENTRY, matrices=1)
    assert roomy.store(diffuse, 0.95) is diffuse  # keeping 95 % costs more than dense: dense


def test_a_file_with_issue_20s_top_k_rows_still_loads(tmp_path) -> None:
    """Written before issue 29: `{top_k, columns, total, kept_mass}` with `.indices` / `.values` [R, k]."""
    import json

    from safetensors.numpy import save_file

    from models.affinity.file import AffinityResult
    from models.base.shapes import ModelShape

    rng = np.random.default_rng(7)
    groups, neurons = 2, 6
    shape = ModelShape("llama", 2, groups, 4, neurons)
    matrix = rng.lognormal(0.0, 1.0, (neurons, neurons))
    top = SparseEdge.top_k(matrix, 2)
    tensors = {"up_fo.0": rng.random((groups, neurons)), "up_fo.1": rng.random((groups, neurons)),
               "up_add.0": rng.random((groups, neurons)), "up_add.1": rng.random((groups, neurons)),
               "down.0": rng.random((neurons, groups)), "edge.0.2.fo": rng.random((groups, groups))}
    tensors["edge.0.2.add"] = tensors["edge.0.2.fo"]
    old = {"top_k": 2, "columns": neurons, "total": float(matrix.sum()), "kept_mass": top.kept_mass}
    for name in ("fo", "add"):
        tensors[f"edge.1.3.{name}.indices"] = top.cols.reshape(neurons, 2).astype(np.int64)
        tensors[f"edge.1.3.{name}.values"] = top.values.reshape(neurons, 2)
    edges = [{"from": 0, "to": 2, "fo": "dense", "add": "dense"}, {"from": 1, "to": 3, "fo": old, "add": old}]
    meta = {"format": "dtp-layout-affinity/1", "tokens": "8", "shape": json.dumps(shape.__dict__),
            "schedule": "dtp:2", "edges": json.dumps(edges)}
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata=meta)
    loaded = AffinityResult.load(tmp_path / "old.safetensors").edges[(1, 3)]["fo"]
    assert isinstance(loaded, SparseEdge) and loaded.shape == (neurons, neurons)
    np.testing.assert_array_equal(loaded.dense(), top.dense())
    assert loaded.total == pytest.approx(matrix.sum()) and loaded.kept_mass == pytest.approx(top.kept_mass)
