"""vLLM serves the MoE families' shards (issue 46) with the project runtime's greedy tokens, in fp32, under tp,
dtp:1, dtp:2 and pt:2: vLLM's own MoE layer (FusedMoE, 1/L of every expert's neurons per rank, its final
all-reduce deferred to the schedule), each rank routing its own stream.

Each engine (family × schedule) is loaded once by this session's engine host (tests/models/serving/
vllm_host.py; TP = 2 on the CPU, fp32, eager, --max-num-batched-tokens 16 so the longest prompt is prefilled
in chunks) and asked for one batch of three prompts of different lengths in each exchange mode (switched
inside the loaded engine). The reference is the project's runtime (`models.runtime`, what `dtp-layout
generate` runs) on the same shards. Skipped without .venv-vllm (`make vllm-env`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from models.runtime import DTPRuntime
from tests.models.serving.vllm_kit import EngineHost, HostedEngine, vllm_missing
from tests.tiny import tokens

# split_by_param("engine"): an engine's tests are one xdist unit (one engine load), as in test_vllm.py
pytestmark = [pytest.mark.vllm, pytest.mark.split_by_param("engine"),
              pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")]

PROMPT_LENGTHS = (5, 19, 37)
MAX_TOKENS = 10
VOCAB = 97
ENGINES = [(case, schedule) for case in ("qwen3_moe", "mixtral") for schedule in ("tp", "dtp:1", "dtp:2", "pt:2")]
MODES = ("eager", "overlap")
Engine = tuple[str, str, Path, HostedEngine]
REFERENCES: dict[Path, list[list[int]]] = {}


def _prompts() -> list[list[int]]:
    return [tokens(1, n, vocab=VOCAB, seed=n).tolist()[0] for n in PROMPT_LENGTHS]


def export_moe(out: Path, case: str, schedule: str) -> Path:
    """`out/shards` of the case's seed-0 tiny MoE model under a random per-expert balanced layout (L = 2)."""
    from models.export.resident import export_rank_shards, permuted_copy
    from tests.models.moe_kit import balanced_moe_layout, moe_model

    model = moe_model(case)
    layout = balanced_moe_layout(model, 2, seed=11)
    export_rank_shards(permuted_copy(model, layout), layout, out / "shards", schedule=schedule)
    return out / "shards"


@pytest.fixture(scope="session")
def moe_engine_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    host = EngineHost(tmp_path_factory.mktemp("vllm-moe-host") / "host.log")
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture(scope="module", params=ENGINES, ids=["-".join(e) for e in ENGINES])
def engine(request: pytest.FixtureRequest, moe_engine_host: EngineHost,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    case, schedule = request.param
    root = tmp_path_factory.getbasetemp() / "vllm-moe-exports" / f"{case}-{schedule.replace(':', '_')}"
    shards = root / "shards" if (root / "shards").is_dir() else export_moe(root, case, schedule)
    server = moe_engine_host.load(shards, engine_args={"skip_tokenizer_init": True})  # token ids in and out
    print(f"\nvLLM engine {case}-{schedule} (engine host): ready in {server.start_s:.1f} s")
    try:
        yield case, schedule, shards, server
    finally:
        server.stop()


def _reference(rt: DTPRuntime, shards: Path) -> list[list[int]]:
    if shards not in REFERENCES:
        rt.load(shards)
        REFERENCES[shards] = [rt.generate(np.asarray([p]), max_new_tokens=MAX_TOKENS, stop_at_eos=False)
                              .tokens.tolist()[0] for p in _prompts()]
    return REFERENCES[shards]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_equal_the_runtime(engine: Engine, runtime2: DTPRuntime, mode: str) -> None:
    """A batch of three prompts (the longest prefilled in chunks): vLLM's greedy tokens are the runtime's."""
    case, schedule, shards, server = engine
    assert server.configure(mode) == [f"Dtp{'Qwen3Moe' if case == 'qwen3_moe' else 'Mixtral'}ForCausalLM"] * 2
    got = server.complete(_prompts(), MAX_TOKENS)
    want = _reference(runtime2, shards)
    assert got == want, f"{case} {schedule} ({mode}): vLLM {got} != runtime {want}"


def test_the_schedules_differ(engine: Engine, runtime2: DTPRuntime) -> None:
    """Not vacuous: on the same layout, each schedule's tokens differ from tp's somewhere in the batch."""
    case, schedule, shards, _ = engine
    if schedule == "tp":
        pytest.skip("the reference schedule")
    tp = runtime2
    tp.load(shards)
    at_tp = [tp.generate(np.asarray([p]), max_new_tokens=MAX_TOKENS, stop_at_eos=False, schedule_override="tp")
             .tokens.tolist()[0] for p in _prompts()]
    assert at_tp != _reference(runtime2, shards), f"{case} {schedule}: the same tokens as tp"
