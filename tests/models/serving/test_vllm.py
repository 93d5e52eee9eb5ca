"""vLLM serves the exported shards with the project runtime's tokens (issues 28, 42), in both exchange modes
and under an emulated link latency.

Each engine (TP = 2 on the CPU, fp32, eager) is started once per (family, schedule, load path) and shared by
that engine's tests (module-scoped, parametrized: one engine at a time in a process; under xdist the engines
go to the workers one by one). Two run as vLLM's OpenAI server from .venv-vllm, as docs/serving.md has users
run it: the llama dtp:1 shards through `dtp-layout vllm-serve --exchange overlap` with no dtype (the shards'
fp32 is its default) and no other vLLM flag but the test's chunking (also compared with the `generate`
command, and stopped by SIGTERM to the command), and the checkpoint with the table on the server's
--hf-overrides. The others are loaded by this session's engine host (vllm_host.py: `vllm.LLM` in one process
that imported vLLM once; the same plugin, model classes, executor and TP workers), which readies an engine
in ~10 s instead of the server's ~25 s on an idle machine, and switches the plugin's exchange mode and link
latency within one load (`LLM.collective_rpc`), so both modes are checked without a second engine. The hosted
llama shards engines (tp, dtp:2, pt:2, spd:1, ladder: one random layout, so byte-identical rank shards, checked)
are one load switched in place to each schedule (`DtpModel.reschedule`, the prefix cache dropped), as the MoE
engines are (test_vllm_moe.py): one xdist unit, one start instead of five.
Every engine runs with --max-num-batched-tokens 16, so the longer prompts are prefilled in chunks, and
every request is a batch of prompts of different lengths sent as token ids at temperature 0. The
reference is the project's runtime (`models.runtime`, what `dtp-layout generate` runs) on the same shards.
Skipped without .venv-vllm (`make vllm-env`); the engines take minutes to start on two cores
(DTP_LAYOUT_VLLM_START_S bounds each start).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from models.export.serving_manifest import hf_overrides
from models.runtime import DTPRuntime
from tests.models.serving.vllm_kit import EngineHost, HostedEngine, Server, export_tiny, runtime_tokens, vllm_missing
from tests.tiny import tokens

# split_by_param("engine"): each engine's tests are a unit of their own under xdist (an engine is started per
# parameter set whatever the grouping; one file of 11 engines was the suite's longest tail, 6 minutes on one
# worker), both exchange modes in it (split by the whole id, a mode's tests started the engine again)

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
# on the OpenAI server, in the exchange mode it runs (the rest hosted, both modes); the first through vllm-serve
SERVED = {("llama", "dtp:1", "shards"): "overlap", ("llama", "dtp:2", "checkpoint"): "eager"}
VIA_COMMAND = ("llama", "dtp:1", "shards")
MODES = ("eager", "overlap")
TIMES: dict[str, float] = {}
REFERENCES: dict[tuple[Path, str | None], list[list[int]]] = {}  # the runtime's tokens, per shards and override
SHARED = ("llama", "shards")  # (case, load path) of the hosted engines that share one load
SWITCHED: set[tuple[str, str, str]] = set()  # the engines that are the shared load switched in place


def load_of(engine: tuple[str, str, str]) -> str:
    """The load an engine runs on: the hosted llama shards engines share one; every other its own."""
    return "llama-shards-hosted" if engine[::2] == SHARED and engine not in SERVED else "-".join(engine)


pytestmark = [pytest.mark.vllm, pytest.mark.split_by_param("engine", unit=load_of),
              pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")]


def _prompts() -> list[list[int]]:
    return [tokens(1, n, vocab=257, seed=n).tolist()[0] for n in PROMPT_LENGTHS]


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


def _rank_files(shards: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(shards.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def kept_load() -> Iterator[dict[str, Any]]:
    """The hosted load the llama shards engines share ({"files": rank file hashes, "server": HostedEngine}),
    kept across their engine fixtures; unloaded with the module (no engine left loaded beside another file's)."""
    kept: dict[str, Any] = {}
    try:
        yield kept
    finally:
        if "server" in kept:
            kept["server"].stop()


def _hosted(request: pytest.FixtureRequest, kept: dict[str, Any], model: Path, overrides: dict[str, Any] | None,
            shared: bool) -> tuple[HostedEngine, str]:
    """A hosted engine on `model`: the kept load switched to this export's schedule where its rank shards are
    the kept ones (how: "switched in place"), else a fresh load (kept if `shared`; the kept one unloaded)."""
    files = _rank_files(model) if shared else None
    if files is not None and kept.get("files") == files:
        server: HostedEngine = kept["server"]
        entry = json.loads((model / "config.json").read_text())["dtp"]
        server.configure(MODES[0], 0.0)  # the mode a fresh load starts in
        assert server.reschedule(entry) == [entry["schedule"]] * 2
        return server, "switched in place"
    if "server" in kept:
        kept.pop("server").stop()
        kept.clear()
    server = request.getfixturevalue("engine_host").load(model, hf_overrides=overrides)
    if files is not None:
        assert len(files) == 2, files
        kept.update(files=files, server=server)
    return server, "engine host"


@pytest.fixture(scope="module", params=ENGINES, ids=["-".join(e) for e in ENGINES])
def engine(request: pytest.FixtureRequest, exports: dict[tuple[str, str], Path], kept_load: dict[str, Any],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    case, schedule, path = request.param
    out = _export(exports, tmp_path_factory.getbasetemp() / "vllm-exports", case, schedule)
    shards = out / "shards"
    model = shards if path == "shards" else out / "checkpoint"
    overrides = hf_overrides(json.loads((shards / "manifest.json").read_text())["serving"]) \
        if path == "checkpoint" else None
    server: Server | HostedEngine
    how = "OpenAI server"
    if request.param == VIA_COMMAND:
        server = Server(model, extra=CHUNK, vllm_serve=["--exchange", SERVED[VIA_COMMAND]])
    elif request.param in SERVED:
        server = Server(model, extra=[*CHUNK, *(["--hf-overrides", json.dumps(overrides)] if overrides else [])])
    else:
        server, how = _hosted(request, kept_load, model, overrides,
                              shared=load_of(request.param) != "-".join(request.param))
    if how == "switched in place":
        SWITCHED.add(request.param)
    TIMES["-".join(request.param)] = 0.0 if request.param in SWITCHED else server.start_s
    print(f"\nvLLM engine {'-'.join(request.param)} ({how}): ready in {TIMES['-'.join(request.param)]:.1f} s")
    try:
        yield case, schedule, path, shards, server
    finally:
        if server is not kept_load.get("server"):
            server.stop()


def _reference(rt: DTPRuntime, shards: Path, prompts: list[list[int]], override: str | None = None) -> list[list[int]]:
    if (shards, override) not in REFERENCES or prompts != _prompts():
        rt.load(shards)
        tokens = [rt.generate(np.asarray([p]), max_new_tokens=MAX_TOKENS, stop_at_eos=False,
                              schedule_override=override).tokens.tolist()[0] for p in prompts]
        if prompts != _prompts():
            return tokens
        REFERENCES[shards, override] = tokens
    return REFERENCES[shards, override]


def _in_mode(engine: Engine, mode: str, link_latency_us: float = 0.0) -> None:
    """Run the engine's plugin in `mode` (hosted: switched in its workers; served: skipped unless its own)."""
    case, schedule, path, _, server = engine
    if path == "plain" and mode != MODES[0]:
        pytest.skip("vLLM's own Llama has no exchange mode")
    if isinstance(server, HostedEngine):
        server.configure(mode, link_latency_us)
    elif SERVED[case, schedule, path] != mode or link_latency_us:
        pytest.skip(f"the served engine runs {SERVED[case, schedule, path]} at 0 µs; the hosted ones both modes")


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_equal_the_runtime(engine: Engine, runtime2: DTPRuntime, mode: str) -> None:
    """A batch of prompts of different lengths, the longest prefilled in chunks: vLLM's greedy tokens are the
    runtime's, in either exchange mode (plain TP, the negative control: they are not, and are the runtime's at
    tp instead)."""
    case, schedule, path, shards, server = engine
    _in_mode(engine, mode)
    prompts = _prompts()
    t0 = time.perf_counter()
    got = server.complete(prompts, MAX_TOKENS)
    elapsed = time.perf_counter() - t0
    want = _reference(runtime2, shards, prompts)
    print(f"{case} {schedule} {path} ({mode}): {len(prompts)} prompts x {MAX_TOKENS} tokens in {elapsed:.2f} s")
    if path == "plain":
        assert got != want, "served as plain TP, the DTP shards' tokens must differ (the test would be vacuous)"
        assert got == _reference(runtime2, shards, prompts, override="tp")
    else:
        assert got == want, f"{case} {schedule} via {path}: vLLM {got} != runtime {want}"
    if (case, schedule, path) in SWITCHED:  # the switch took: not the tokens of the load's first schedule (tp)
        assert got != _reference(runtime2, shards, prompts, override="tp"), f"{schedule}: tp's tokens"


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


LATENCY_US = 4000.0


@pytest.mark.parametrize("mode", MODES)
def test_an_emulated_link_latency_is_paid_and_changes_no_token(engine: Engine, runtime2: DTPRuntime,
                                                              mode: str) -> None:
    """link_latency_us: each exchange usable 4 ms after it completed. The tokens stay the runtime's; tp, which
    waits at once, pays it at each of its 4 exchanges in each of the ≥ 10 engine steps (10 new tokens)."""
    case, schedule, path, shards, server = engine
    if (case, path) != ("llama", "shards") or schedule not in ("tp", "dtp:2"):
        pytest.skip("run on the hosted llama tp and dtp:2 shards engines")
    assert isinstance(server, HostedEngine)
    try:
        _in_mode(engine, mode, LATENCY_US)
        prompts = _prompts()
        got = server.complete(prompts, MAX_TOKENS)
        slowed = server.elapsed_s
    finally:
        server.configure(MODES[0], 0.0)
    assert got == _reference(runtime2, shards, prompts)
    if schedule == "tp":
        paid = MAX_TOKENS * 4 * LATENCY_US * 1e-6  # a lower bound: steps x exchanges x latency
        assert slowed >= paid, f"{slowed:.3f} s for {MAX_TOKENS} tokens at {LATENCY_US:g} µs: not paid ({paid:.2f} s)"


def test_the_exchange_mode_is_printed_at_engine_start(engine: Engine,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """The first TP worker logs the schedule and the settings it runs, and where the mode came from."""
    case, schedule, path, _, server = engine
    if path == "plain":
        pytest.skip("vLLM's own Llama")
    if isinstance(server, Server):
        log, source = server.log, "from DTP_LAYOUT_VLLM_EXCHANGE" if (case, schedule, path) == VIA_COMMAND else \
            "the default on cpu"
    else:
        log, source = server.host.log, "the default on cpu"
    mode = SERVED.get((case, schedule, path), MODES[0])
    line = f"DTP schedule {schedule} on TP=2: exchange {mode} ({source};"
    switched = f"DTP schedule {schedule} on TP=2: exchange {mode} (set by the engine host;"  # ... (switched in place)
    text = log.read_text(errors="replace")
    assert line in text or ((case, schedule, path) in SWITCHED and switched in text), line


def test_sigterm_to_vllm_serve_stops_every_process_it_started(engine: Engine) -> None:
    """Last for its engine: SIGTERM to `dtp-layout vllm-serve` alone (not its group) ends the API server, the
    engine core and both TP workers; none survives and /health stops answering."""
    case, schedule, path, _, server = engine
    if (case, schedule, path) != VIA_COMMAND:
        pytest.skip("run on the engine served through dtp-layout vllm-serve")
    assert isinstance(server, Server)
    command = psutil.Process(server.proc.pid)
    started = command.children(recursive=True)
    assert len(started) >= 3, [p.cmdline() for p in started]  # the API server, the engine core, the TP workers
    os.kill(server.proc.pid, signal.SIGTERM)
    assert server.proc.wait(timeout=120) == 128 + signal.SIGTERM
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"survived SIGTERM to vllm-serve: {[(p.pid, p.cmdline()) for p in alive]}"
    with pytest.raises(OSError):
        Server.complete(server, [[1, 2, 3]], 1)
