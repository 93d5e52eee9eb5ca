"""`dtp-layout export`, `eval` and `demo`: a layout's permuted checkpoint and rank shards, and its dense and
DTP perplexity. Torch-free at import (app/cli/main.py registers them)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from app.cli.args.model import (
    calibration_of,
    check_layout_numbers,
    export_dtype,
    layout_of,
    load_model,
    memory_plan,
    model_config,
    progress_bar,
    weights,
)
from app.cli.args.schedule import command_schedule, schedule_of
from models.layouts.names import CONTIGUOUS, RANDOM_SEED_BASE, random_name


def cmd_export(args: argparse.Namespace) -> int:
    from models.export.writer import export_layout
    from models.io.loading import ModelSource
    from models.streaming.source import layer_source

    schedule = command_schedule(args)  # a bad --schedule fails before anything loads
    config = model_config(args, ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file))
    check_layout_numbers(config, args.devices, args.delta, schedule)  # fail before loading weights
    layout = layout_of(args, config)
    dtype = export_dtype(args, config)
    out = Path(args.out)
    ckpt, shards = out / "checkpoint", out / "shards"
    # read tensor by tensor from the safetensors when the plan streams, else from the loaded model: the same tensors
    model, tokenizer = weights(args, config, memory_plan(args, config, "export"))
    source = layer_source(model)
    export_layout(source, layout, checkpoint_dir=ckpt, shards_dir=shards, dtype=dtype, tokenizer=tokenizer,
                  overwrite=args.overwrite, progress=progress_bar(), schedule=schedule, compute_dtype=source.dtype)
    print(f"layout {layout.name}: L={layout.devices} δ={layout.delta}; weights in "
          f"{str(dtype).removeprefix('torch.')} (computed in {args.dtype})")
    print(f"permuted checkpoint: {ckpt}")
    print(f"rank shards:         {shards} ({layout.devices} files + manifest.json), made for schedule "
          f"{schedule}")
    return 0



def eval_result(args: argparse.Namespace, model: Any, tokenizer: Any, schedule: Any = None
                 ) -> tuple[Any, dict[str, Any] | None]:
    """The evaluation under `schedule` (None: the layout's dtp:δ), and the held-out placement against the
    `--from` run's calibration (or None)."""
    from models.data.calibration import CalibrationSpec, load_blocks
    from models.data.heldout import place
    from models.evaluation.evaluate import evaluate

    layout = layout_of(args, model.config)
    spec = CalibrationSpec(source=args.data, sequences=args.blocks, seq_len=args.seq_len, seed=0,
                           text_field=args.text_field)
    calibration, identity = calibration_of(args)
    placement = None
    if calibration is not None:  # the layout was optimised on these blocks: evaluate after them
        placement = place(None, spec, calibration=calibration, calibration_identity=identity,
                          allow_overlap=getattr(args, "allow_overlap", False))
        spec = placement.eval
    blocks = load_blocks(spec, tokenizer, vocab_size=model.config.vocab_size)
    # in memory or layer by layer (a streamed model): the same statistics
    result = evaluate(model, layout, blocks, batch_size=args.batch_size, last_scale=args.last_scale,
                      schedule=schedule, progress=progress_bar())
    return result, placement.as_dict() if placement is not None else None


def cmd_eval(args: argparse.Namespace) -> int:
    from models.families import model_shape
    from models.io.loading import ModelSource
    from models.schedules.grammar import resolve_schedule

    schedule = schedule_of(args)  # a bad --schedule fails before the weights load
    config = model_config(args, ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file))
    plan = memory_plan(args, config, "eval", tokens=args.blocks * args.seq_len,
                        batch_tokens=min(args.blocks, args.batch_size) * args.seq_len, devices=args.devices)
    model, tokenizer = weights(args, config, plan)
    result, data = eval_result(args, model, tokenizer, schedule)
    syncs = resolve_schedule(result.schedule, model_shape(model.config).num_layers, result.devices,
                             args.last_scale).syncs_per_token
    if args.json:
        print(json.dumps({**result.as_dict(), "syncs_per_token": syncs, **({"data": data} if data else {})}))
    else:
        from models.data.heldout import describe_dict

        for line in describe_dict(data or {}):
            print(f"data: {line}")
        print(f"layout {result.layout}  L={result.devices} δ={result.delta}  "
              f"{result.blocks} blocks × {result.seq_len} tokens")
        print(f"schedule {result.schedule}  {syncs} syncs per token")
        if result.layout_independent:
            print(f"  schedule {result.schedule} is layout-independent (every device's stream holds the full sum): "
                  f"the layout does not change the result")
        print(f"  dense perplexity   {result.dense_ppl:10.3f}")
        print(f"  DTP perplexity     {result.dtp_ppl:10.3f}")
        print(f"  KL(dense ‖ DTP)    {result.kl:10.4f} nats/token")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Evaluate contiguous and random layouts of the packaged SmolLM2-135M on the corpus."""
    from models.io.assets import corpus_file, smollm2_gguf

    gguf, data = smollm2_gguf(), corpus_file("shakespeare")  # the corpus every install has
    print(f"demo: SmolLM2-135M ({gguf.name}), L=3, δ=1, {args.blocks} blocks × {args.seq_len} tokens of {data}")
    ns = argparse.Namespace(model=str(gguf), revision=None, gguf_file=None, dtype="float32",
                            no_convert_cache=args.no_convert_cache,
                            device=args.device, devices=3, delta=1, data=str(data), blocks=args.blocks,
                            seq_len=args.seq_len, text_field="text", batch_size=1, last_scale="sqrt")
    model, tokenizer = load_model(ns)
    print(f"{'layout':<14}{'dense ppl':>12}{'DTP ppl':>12}{'KL nats/tok':>14}")
    for layout in (CONTIGUOUS, random_name(RANDOM_SEED_BASE), random_name(RANDOM_SEED_BASE + 1)):
        ns.layout = layout
        r, _ = eval_result(ns, model, tokenizer)
        print(f"{layout:<14}{r.dense_ppl:>12.3f}{r.dtp_ppl:>12.3f}{r.kl:>14.4f}")
    print(f"next: `dtp-layout export MODEL --layout {random_name(RANDOM_SEED_BASE)} --devices 3 --delta 1 --out DIR`")
    return 0

