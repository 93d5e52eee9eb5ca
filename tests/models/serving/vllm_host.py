"""A vLLM engine host for the tests: one Python process of .venv-vllm that imports vLLM once and then loads,
runs and unloads engines one after another (`vllm.LLM`, its engine core in this process, the TP ranks in
vLLM's own worker processes), driven by JSON lines on stdin; each reply is one JSON line on stdout.

Why: an OpenAI server starts four processes that each import vLLM (~9 s of CPU apiece): the API server, the
engine core and two TP workers. The host pays the first two once per test session, so an engine is ready in
~10 s instead of ~25 s on an idle 2-core machine (60-98 s under the suite's load). The model classes, the
plugin, the executor and the TP workers are the same as under `vllm serve`; tests/models/serving/test_vllm.py
keeps the server for the engines that check what only the server does (the documented `vllm serve` command,
--hf-overrides given on its command line).

Requests: {"op": "load", "model": DIR, "tp": 2, "max_num_batched_tokens": 16, "hf_overrides": {...}},
{"op": "complete", "prompts": [[ids]], "max_tokens": N} (the reply has the tokens and "elapsed_s"),
{"op": "configure", "exchange": MODE, "link_latency_us": X} (the DTP plugin's settings, switched in every TP
worker's model through `LLM.collective_rpc`: one load serves both exchange modes and every latency),
{"op": "reschedule", "entry": {...}} (the schedule of a config's `dtp` entry, switched the same way, and the
prefix cache dropped: one load serves every schedule of the same rank shards), {"op": "unload"},
{"op": "exit"}. Replies carry "ok" or "error" (the traceback's text). vLLM's own prints and logs go to stderr
(the client's log file).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any, TextIO


def _reply(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def configure_worker(worker: Any, exchange: str, link_latency_us: float) -> str:
    """In a TP worker (through collective_rpc): the DTP model's exchange settings; its class name."""
    model = worker.get_model()
    if hasattr(model, "model") and hasattr(model.model, "configure"):
        # the options of the plugin package the model came from: the dtp-layout-vllm wheel's
        # (dtp_layout_vllm._models.serving.vllm), never the checkout's models/ on PYTHONPATH
        plugin = type(model.model).__module__.rpartition(".")[0]
        settings = importlib.import_module(plugin + ".options").PluginSettings
        model.model.configure(settings(exchange, float(link_latency_us), "set by the engine host"))
    return type(model).__name__


def reschedule_worker(worker: Any, entry: dict[str, Any]) -> str:
    """In a TP worker (through collective_rpc): the DTP model runs under the schedule of this `dtp` entry."""
    model = worker.get_model()
    model.model.reschedule(entry)
    return str(model.model.schedule.name)


def main() -> None:
    # The replies keep the real stdout; everything else printed to fd 1 (vLLM, its workers) goes to the log.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, not a fifth one
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    _reply(replies, {"ok": True, "import_s": time.perf_counter() - t0})
    llm: Any = None

    def unload() -> None:
        nonlocal llm
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()  # the TP workers exit
            llm = None
            gc.collect()
            cleanup_dist_env_and_memory()

    for line in sys.stdin:
        request = json.loads(line)
        op = request.get("op")
        try:
            if op == "load":
                unload()
                t = time.perf_counter()
                llm = LLM(model=request["model"], tensor_parallel_size=int(request.get("tp", 2)),
                          dtype=request.get("dtype", "float32"),
                          enforce_eager=True, max_model_len=int(request.get("max_model_len", 256)), max_num_seqs=8,
                          max_num_batched_tokens=int(request.get("max_num_batched_tokens", 16)),
                          hf_overrides=request.get("hf_overrides"), seed=0, **request.get("engine_args", {}))
                _reply(replies, {"ok": True, "start_s": time.perf_counter() - t})
            elif op == "complete":
                params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=True)
                t = time.perf_counter()
                outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], params,
                                       use_tqdm=False)
                _reply(replies, {"ok": True, "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                                 "elapsed_s": time.perf_counter() - t})
            elif op == "configure":
                names = llm.collective_rpc(configure_worker, args=(request["exchange"],
                                                                   float(request.get("link_latency_us", 0.0))))
                _reply(replies, {"ok": True, "models": names})
            elif op == "reschedule":
                names = llm.collective_rpc(reschedule_worker, args=(request["entry"],))
                if not llm.reset_prefix_cache():  # the cached KV was computed under the old schedule
                    raise RuntimeError("vLLM could not drop its prefix cache after the schedule changed")
                _reply(replies, {"ok": True, "schedules": names})
            elif op == "unload":
                unload()
                _reply(replies, {"ok": True})
            elif op == "exit":
                unload()
                _reply(replies, {"ok": True})
                return
            else:
                _reply(replies, {"error": f"unknown op {op!r}: load, complete, unload or exit"})
        except Exception:
            _reply(replies, {"error": traceback.format_exc()})


if __name__ == "__main__":  # vLLM's TP workers are spawned: they re-import this module and must not run main()
    main()
