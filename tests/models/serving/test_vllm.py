"""vLLM serves the exported shards with the project runtime's tokens (issue 28).

Each engine (TP = 2 on the CPU, fp32, eager) is started once per (family, schedule, load path) and shared by
that engine's tests (module-scoped, parametrized: one engine at a time in a process; under xdist the engines
go to the workers one by one). Two run as vLLM's OpenAI server from .venv-vllm, as docs/serving.md has users
run it: the llama dtp:1 shards (also compared with the `generate` command) and the checkpoint with the table
on the server's --hf-overrides. The others are loaded by this session's engine host (vllm_host.py: `vllm.LLM`
in one process that imported vLLM once; the same plugin, model classes, executor and TP workers), which
readies an engine in ~10 s instead of the server's ~25 s on an idle machine.
Every engine runs with --max-num-batched-tokens 16, so the longer prompts are prefilled in chunks, and
every request is a batch of prompts of different lengths sent as token ids at temperature 0. The
reference is the project's runtime (`models.runtime`, what `dtp-layout generate` runs) on the same shards.
Skipped without .venv-vllm (`make vllm-env`); the engines take minutes to start on two cores
(DTP_LAYOUT_VLLM_START_S bounds each start).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from models.runtime import DTPRuntime
from models.serving.manifest import hf_overrides
from tests.models.serving.vllm_kit import EngineHost, HostedEngine, Server, export_tiny, runtime_tokens, vllm_missing
from tests.tiny import tokens

# split_by_param: each engine's tests are a unit of their own under xdist (an engine is started per parameter
# set whatever the grouping; one file of 11 engines was the suite's longest tail, 6 minutes on one worker)
pytestmark = [pytest.mark.vllm, pytest.mark.split_by_param,
              pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")]

PROMPT_LENGTHS = (5, 19, 37)  # 37 > 16: two chunks and a remainder under --max-num-batched-tokens 16
MAX_TOKENS = 10
CHUNK = ["--max-num-batched-tokens", "16"]

# (family case, schedule, how vLLM loads it): "shards" = shards/ (the DTP architecture its config names),
# "checkpoint" = the permuted HF checkpoint with the shards' table through --hf-overrides, "plain" = that
# checkpoint as vLLM's own Llama (plain TP: the negative control).
ENGINES = [("llama", "tp", "shards"), ("llama", "dtp:1", "shards"), ("llama", "dtp:2", "shards"),
           ("llama", "pt:2", "shards"), ("llama", "spd:1", "shards"), ("llama", "ladder", "shards"),
           ("qwen3", "dtp:1", "shards"), ("qwen2", "pt:2", "shards"), ("mistral", "ladder", "shards"),
           ("llama", "dtp:2", "checkpoint"), ("llama", "dtp:1", "plain")]
Engine = tuple[str, str, str, Path, "Server | HostedEngine"]  # case, schedule, load path, shards, the engine
SERVED = {("llama", "dtp:1", "shards"), ("llama", "dtp:2", "checkpoint")}  # on the OpenAI server; the rest hosted
TIMES: dict[str, float] = {}


def _prompts() -> list[list[int]]:
    return [tokens(1, n, vocab=257, seed=n).tolist()[0] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def runtime2() -> Iterator[DTPRuntime]:
    rt = DTPRuntime.start(world_size=2, backend="gloo", timeout_s=60.0, threads=1)
    try:
        yield rt
    finally:
        rt.stop()


@pytest.fixture(scope="session")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """The exports made so far under this session's base temp directory, which outlives a module's fixtures:
    with the file split by parameter set, a worker may run `llama-dtp:1-shards`, another file, then
    `llama-dtp:1-plain`, and a module-scoped cache forgot the first export while its directory remained."""
    return {}


def _export(exports: dict[tuple[str, str], Path], root: Path, case: str, schedule: str) -> Path:
    if (case, schedule) not in exports:
        exports[case, schedule] = export_tiny(root / f"{case}-{schedule.replace(':', '_').replace(',', '-')}",
                                              case=case, schedule=schedule)
    return exports[case, schedule]


@pytest.fixture(scope="session")
def engine_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    """One engine host per test process (per xdist worker), started when its first hosted engine is wanted."""
    host = EngineHost(tmp_path_factory.mktemp("vllm-host") / "host.log")
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture(scope="module", params=ENGINES, ids=["-".join(e) for e in ENGINES])
def engine(request: pytest.FixtureRequest, exports: dict[tuple[str, str], Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    case, schedule, path = request.param
    out = _export(exports, tmp_path_factory.getbasetemp() / "vllm-exports", case, schedule)
    shards = out / "shards"
    model = shards if path == "shards" else out / "checkpoint"
    overrides = hf_overrides(json.loads((shards / "manifest.json").read_text())["serving"]) \
        if path == "checkpoint" else None
    server: Server | HostedEngine
    if request.param in SERVED:
        server = Server(model, extra=[*CHUNK, *(["--hf-overrides", json.dumps(overrides)] if overrides else [])])
    else:
        server = request.getfixturevalue("engine_host").load(model, hf_overrides=overrides)
    TIMES["-".join(request.param)] = server.start_s
    how = "OpenAI server" if request.param in SERVED else "engine host"
    print(f"\nvLLM engine {'-'.join(request.param)} ({how}): ready in {server.start_s:.1f} s")
    try:
        yield case, schedule, path, shards, server
    finally:
        server.stop()


def _reference(rt: DTPRuntime, shards: Path, prompts: list[list[int]], override: str | None = None) -> list[list[int]]:
    rt.load(shards)
    return [rt.generate(np.asarray([p]), max_new_tokens=MAX_TOKENS, stop_at_eos=False,
                        schedule_override=override).tokens.tolist()[0] for p in prompts]


def test_greedy_tokens_equal_the_runtime(engine: Engine, runtime2: DTPRuntime) -> None:
    """A batch of prompts of different lengths, the longest prefilled in chunks: vLLM's greedy tokens are the
    runtime's (plain TP, the negative control: they are not, and are the runtime's at tp instead)."""
    case, schedule, path, shards, server = engine
    prompts = _prompts()
    t0 = time.perf_counter()
    got = server.complete(prompts, MAX_TOKENS)
    elapsed = time.perf_counter() - t0
    want = _reference(runtime2, shards, prompts)
    print(f"{case} {schedule} {path}: {len(prompts)} prompts x {MAX_TOKENS} tokens in {elapsed:.2f} s")
    if path == "plain":
        assert got != want, "served as plain TP, the DTP shards' tokens must differ (the test would be vacuous)"
        assert got == _reference(runtime2, shards, prompts, override="tp")
    else:
        assert got == want, f"{case} {schedule} via {path}: vLLM {got} != runtime {want}"


def test_single_requests_equal_the_batch(engine: Engine) -> None:
    """Each prompt alone gives the tokens it gets in the batch (no cross-talk between sequences)."""
    _, _, path, _, server = engine
    if path != "shards":
        pytest.skip("checked on the shards engines")
    prompts = _prompts()
    batch = server.complete(prompts, MAX_TOKENS)
    assert [server.complete([p], MAX_TOKENS)[0] for p in prompts] == batch


def test_the_generate_command_gives_the_same_tokens(engine: Engine) -> None:
    """`dtp-layout generate --ids ... --json` itself (the CLI, its own rank processes) on the dtp:1 shards."""
    case, schedule, path, shards, server = engine
    if (case, schedule, path) != ("llama", "dtp:1", "shards"):
        pytest.skip("run on the llama dtp:1 shards engine")
    prompts = _prompts()[:2]
    assert runtime_tokens(shards, prompts, MAX_TOKENS) == server.complete(prompts, MAX_TOKENS)
