"""vLLM serves the MoE families' shards (issue 46) with the project runtime's greedy tokens, in fp32, under tp,
dtp:1, dtp:2 and pt:2: vLLM's own MoE layer (FusedMoE, 1/L of every expert's neurons per rank, its final
all-reduce deferred to the schedule), each rank routing its own stream.

One engine per family, loaded by this session's engine host (tests/models/serving/vllm_host.py; TP = 2 on the
CPU, fp32, eager, --max-num-batched-tokens 16 so the longest prompt is prefilled in chunks) from the tp shards.
Export writes the same rank shards under every schedule (checked here, byte for byte), so the engine is switched
in place to each other schedule's `dtp` entry (`DtpModel.reschedule`, its prefix cache dropped) instead of being
loaded again: an MoE engine took 200-300 s to load under the suite's load, eight of them a quarter of the suite.
The engine loads the tp shards (their config's schedule set at construction by the same `reschedule`). Each
schedule is asked
for one batch of three prompts of different lengths in each exchange mode. The reference is the project's
runtime (`models.runtime`, what `dtp-layout generate` runs) on that schedule's shards. Skipped without
.venv-vllm (`make vllm-env`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from models.runtime import DTPRuntime
from tests.models.serving.vllm_kit import EngineHost, HostedEngine, vllm_missing
from tests.tiny import tokens

# Not split by parameter: the file is one xdist unit, so its two engines load one after the other. Split, the
# suite loaded both at once on two workers and each missed the host's 420 s start bound on two loaded cores.
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")]

PROMPT_LENGTHS = (5, 19, 37)
MAX_TOKENS = 10
VOCAB = 97
FAMILIES = ("qwen3_moe", "mixtral")
SCHEDULES = ("tp", "dtp:1", "dtp:2", "pt:2")  # the first is the one the engine is loaded with
MODES = ("eager", "overlap")
Engine = tuple[str, Path, HostedEngine]  # family case, the exports' root, the engine
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


def shards_of(root: Path, case: str, schedule: str) -> Path:
    """The case's shards under `schedule`, exported once per session under `root`."""
    out = root / f"{case}-{schedule.replace(':', '_')}"
    return out / "shards" if (out / "shards").is_dir() else export_moe(out, case, schedule)


def _rank_files(shards: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(shards.glob("*.safetensors"))}


@pytest.fixture(scope="session")
def moe_engine_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    host = EngineHost(tmp_path_factory.mktemp("vllm-moe-host") / "host.log")
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request: pytest.FixtureRequest, moe_engine_host: EngineHost,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    case = request.param
    root = tmp_path_factory.getbasetemp() / "vllm-moe-exports"
    shards = shards_of(root, case, SCHEDULES[0])
    server = moe_engine_host.load(shards, engine_args={"skip_tokenizer_init": True})  # token ids in and out
    print(f"\nvLLM engine {case} (engine host): ready in {server.start_s:.1f} s")
    try:
        yield case, root, server
    finally:
        server.stop()


def _reference(rt: DTPRuntime, shards: Path) -> list[list[int]]:
    if shards not in REFERENCES:
        rt.load(shards)
        REFERENCES[shards] = [rt.generate(np.asarray([p]), max_new_tokens=MAX_TOKENS, stop_at_eos=False)
                              .tokens.tolist()[0] for p in _prompts()]
    return REFERENCES[shards]


def _under(engine: Engine, schedule: str) -> Path:
    """Switch the engine to `schedule` (the entry its own export's config records); that export's shards."""
    case, root, server = engine
    shards = shards_of(root, case, schedule)
    assert _rank_files(shards) == _rank_files(shards_of(root, case, SCHEDULES[0])), \
        f"{case}: the {schedule} rank shards differ from the loaded ones; a switch in place would be wrong"
    entry = json.loads((shards / "config.json").read_text())["dtp"]
    assert server.reschedule(entry) == [schedule] * 2
    return shards


def test_one_load_serves_every_schedule_of_the_same_shards(engine: Engine) -> None:
    """What the switch rests on: the rank shards are byte-identical under every schedule; only config.json's
    `dtp` entry (and the manifest's schedule) differ."""
    case, root, _ = engine
    files = {s: _rank_files(shards_of(root, case, s)) for s in SCHEDULES}
    assert len(files[SCHEDULES[0]]) == 2 and all(f == files[SCHEDULES[0]] for f in files.values()), files
    entries = {json.dumps(json.loads((shards_of(root, case, s) / "config.json").read_text())["dtp"],
                          sort_keys=True) for s in SCHEDULES}
    assert len(entries) == len(SCHEDULES)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_greedy_tokens_equal_the_runtime(engine: Engine, runtime2: DTPRuntime, schedule: str, mode: str) -> None:
    """A batch of three prompts (the longest prefilled in chunks): vLLM's greedy tokens are the runtime's."""
    case, _, server = engine
    shards = _under(engine, schedule)
    assert server.configure(mode) == [f"Dtp{'Qwen3Moe' if case == 'qwen3_moe' else 'Mixtral'}ForCausalLM"] * 2
    got = server.complete(_prompts(), MAX_TOKENS)
    want = _reference(runtime2, shards)
    assert got == want, f"{case} {schedule} ({mode}): vLLM {got} != runtime {want}"


@pytest.mark.parametrize("schedule", SCHEDULES[1:])
def test_the_schedules_differ(engine: Engine, runtime2: DTPRuntime, schedule: str) -> None:
    """Not vacuous: on the same layout, each schedule's tokens differ from tp's somewhere in the batch."""
    case, root, _ = engine
    at_tp = _reference(runtime2, shards_of(root, case, "tp"))
    assert at_tp != _reference(runtime2, shards_of(root, case, schedule)), f"{case} {schedule}: the same tokens as tp"
