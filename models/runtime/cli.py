"""`dtp-layout generate` / `python -m models.runtime`: run rank shards, print the text and the timings.

    dtp-layout generate runs/smollm2/shards --prompt "In the beginning" --max-new-tokens 32
    dtp-layout generate SHARDS --prompt "..." --schedule pt:2                   # refused unless made for pt:2
    dtp-layout generate SHARDS --ids prompt.npy --schedule-override tp --json   # the TP timing baseline
    torchrun --nproc-per-node 3 -m models.runtime SHARDS --prompt "..."          # ranks from torchrun

Started plainly, it launches one process per rank itself (`models.runtime.launcher`); started by
torchrun (RANK, WORLD_SIZE, MASTER_ADDR in the environment), this process is one rank and rank 0
prints. Torch-free at import (the `dtp-layout` CLI registers it without loading torch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from models.schedules.grammar import accepted_forms, dtp_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("shards", metavar="SHARDS_DIR", help="a shards/ directory written by export, optimise or a job")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text (needs the tokenizer saved beside the shards)")
    source.add_argument("--ids", metavar="FILE.npy", help="prompt token ids: a 1-D array, or 2-D [batch, tokens]")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default: 32)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--schedule", default=None, metavar="S",
                       help=f"the communication schedule: {accepted_forms(auto=False)} (default: the "
                            "manifest's, which shards from before schedules were recorded give as dtp:δ); shards "
                            "made for another schedule are refused")
    which.add_argument("--schedule-override", default=None, metavar="S",
                       help="run the shards at schedule S although they were made for another, e.g. tp (a blocking "
                            "all-reduce after every module) as the timing baseline; the tokens are then not the "
                            "exported model's")
    which.add_argument("--delta-override", type=int, default=None, metavar="D",
                       help="short for --schedule-override dtp:D (0 = standard tensor parallelism)")
    p.add_argument("--last-scale", default="sqrt", choices=["sqrt", "one"],
                   help="own-scale of the last δ modules, as the model was distilled (default: sqrt)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: nccl with one GPU per rank, else gloo on CPU")
    p.add_argument("--link-latency-us", type=float, default=0.0, metavar="X",
                   help="emulate a slower link: each collective's result is usable X µs after it completed")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="limit on every collective and on the rendezvous (default: 60)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: CPUs / ranks)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: prompt and generated ids, text, per-rank ms/token and blocked ms/token")


def _read_ids(path: str) -> Any:
    from models.data.calibration import read_token_ids

    ids = read_token_ids(Path(path), label=f"--ids {path}")
    if ids.ndim not in (1, 2) or ids.size == 0:
        raise ValueError(f"--ids {path}: expected a non-empty 1-D or 2-D integer array, got {ids.dtype} {ids.shape}")
    return ids if ids.ndim == 2 else ids[None]


def _options(args: argparse.Namespace) -> dict[str, Any]:
    override = args.schedule_override if args.delta_override is None else dtp_text(args.delta_override)
    return dict(max_new_tokens=args.max_new_tokens, schedule=args.schedule, schedule_override=override,
                last_scale=args.last_scale,
                temperature=args.temperature, top_k=args.top_k, seed=args.seed, stop_at_eos=not args.ignore_eos,
                link_latency_us=args.link_latency_us)


def _report(result: Any, args: argparse.Namespace, prompt_text: list[str] | None) -> None:
    if args.json:
        print(json.dumps({"prompt": args.prompt, **result.as_dict()}))
        return
    for i, row in enumerate(result.tokens.tolist()):
        if result.text is not None:
            print((prompt_text[i] if prompt_text else "") + result.text[i])
        else:
            print(" ".join(map(str, row)))
    mode = f"schedule {result.schedule}" + (" (tensor parallel)" if result.schedule in ("tp", "dtp:0") else "")
    print(f"{mode}, L={result.devices}, {result.backend}, link latency {result.link_latency_us:g} µs", file=sys.stderr)
    for r in result.ranks:
        per_token = "n/a" if r.ms_per_token is None else f"{r.ms_per_token:.2f} ms/token"
        blocked = "n/a" if r.blocked_ms_per_token is None else f"{r.blocked_ms_per_token:.2f} ms/token"
        print(f"  rank {r.rank}: decode {per_token}, blocked {blocked}, prefill {r.prefill_ms:.1f} ms "
              f"({r.decode_steps} decode steps)", file=sys.stderr)


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _loaded_line(info: Any, world_size: int, backend: str, seconds: float) -> str:
    return (f"loaded {info.model_type} layout {info.layout!r} on {world_size} ranks ({backend}, {info.dtype}) "
            f"in {seconds:.1f} s; generating …")


def run_local(args: argparse.Namespace) -> int:
    import time

    from models.runtime.launcher import DTPRuntime, has_tokenizer, manifest_devices, stop_forkserver

    manifest_devices(args.shards)  # a missing or unreadable manifest is refused before any process starts
    if args.prompt is not None and not has_tokenizer(args.shards):
        raise ValueError(f"{args.shards} has no tokenizer (tokenizer.json): pass --ids FILE.npy instead of --prompt")
    ids = _read_ids(args.ids) if args.ids is not None else None
    t0 = time.perf_counter()
    rt = DTPRuntime.start(args.shards, backend=args.backend, timeout_s=args.timeout_s, threads=args.threads)
    print(_loaded_line(rt.info, rt.world_size, rt.backend, time.perf_counter() - t0), file=sys.stderr, flush=True)
    try:
        prompt_text = None
        if args.prompt is not None:
            result = rt.generate_text(args.prompt, **_options(args))
            prompt_text = [args.prompt]
        else:
            result = rt.generate(ids, **_options(args))
            if rt.tokenizer is not None:
                prompt_text = [rt.tokenizer.decode(row, skip_special_tokens=True) for row in result.prompt_ids.tolist()]
    except BaseException:
        rt.stop(force=True)
        stop_forkserver()  # after the ranks (its children): else it outlives this command by seconds
        raise
    rt.stop()
    stop_forkserver()
    _report(result, args, prompt_text)
    return 0


def run_torchrun(args: argparse.Namespace) -> int:
    """This process is one rank of a torchrun job: load, generate, rank 0 prints."""
    import time

    import numpy as np
    import torch

    from models.runtime.generation import GenerateRequest
    from models.runtime.group import RankGroup
    from models.runtime.launcher import load_tokenizer, resolve_backend
    from models.runtime.rank import RankWorker

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    backend = resolve_backend(args.backend, local_world)
    if args.threads:
        torch.set_num_threads(args.threads)
    group = RankGroup.from_env(backend=backend, timeout_s=args.timeout_s)
    try:
        worker = RankWorker(group)
        t0 = time.perf_counter()
        info = worker.load(args.shards)
        if group.rank == 0:
            print(_loaded_line(info, group.world_size, backend, time.perf_counter() - t0), file=sys.stderr, flush=True)
        prompt, error = None, None
        if group.rank == 0:  # tokenize once, share the ids (and any input error) with every rank
            try:
                tokenizer = load_tokenizer(args.shards)
                if args.prompt is not None:
                    if not tokenizer:
                        raise ValueError(f"{args.shards} has no tokenizer: pass --ids FILE.npy")
                    ids = tokenizer(args.prompt, return_tensors="np")["input_ids"]
                else:
                    ids = _read_ids(args.ids)
                prompt = ids
            except ValueError as exc:
                error = str(exc)
        prompt, error = group.broadcast_object((prompt, error), "sharing the prompt")
        if error is not None:
            raise ValueError(error)
        opts = _options(args)
        override = opts["schedule_override"]
        request = GenerateRequest(np.asarray(prompt), opts["max_new_tokens"], schedule=opts["schedule"] or override,
                                  override=override is not None, last_scale=opts["last_scale"],
                                  temperature=opts["temperature"], top_k=opts["top_k"], seed=opts["seed"],
                                  stop_ids=info.eos_token_ids if opts["stop_at_eos"] else (),
                                  link_latency_us=opts["link_latency_us"])
        result = worker.generate(request)
        if result is not None:
            tokenizer = load_tokenizer(args.shards)
            prompt_text = None
            if tokenizer:
                result.text = [tokenizer.decode(row, skip_special_tokens=True) for row in result.tokens.tolist()]
                prompt_text = [tokenizer.decode(row, skip_special_tokens=True) for row in result.prompt_ids.tolist()]
            _report(result, args, prompt_text)
    finally:
        group.close()
    return 0


def run(args: argparse.Namespace) -> int:
    return run_torchrun(args) if _under_torchrun() else run_local(args)


def main(argv: list[str] | None = None) -> int:
    """`python -m models.runtime`: user errors exit 2 with one line, a failed rank exits 1."""
    parser = argparse.ArgumentParser(prog="python -m models.runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    from models.runtime.errors import RankFailure

    try:
        return run(args)
    except KeyboardInterrupt:
        print("generate: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    except RankFailure as exc:
        print(f"generate: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # ShardError is a ValueError too
        if not _under_torchrun() or os.environ.get("RANK") == "0":
            print(f"generate: error: {exc}", file=sys.stderr)
        return 2
