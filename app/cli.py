"""The `dtp-layout` command line.

Heavy modules (torch, transformers, models.*) are imported inside the commands, so that
`dtp-layout --help` is instant and the API process never imports torch through this module.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class CliError(Exception):
    """An error the user can fix: printed without a traceback, exit status 2."""


def _progress_bar() -> Callable[[str, float], None]:
    """A callback(stage, fraction) that draws one tqdm bar per stage on stderr."""
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def update(stage: str, fraction: float) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=1000, desc=stage, unit="‰", file=sys.stderr, leave=False,
                                     disable=None)
        bar.n = round(fraction * 1000)
        bar.refresh()
        if fraction >= 1.0:
            bar.close()

    return update


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="hub id (owner/name), a local checkpoint directory, or a local .gguf file")
    p.add_argument("--revision", help="hub revision (branch, tag or commit)")
    p.add_argument("--gguf-file", help="GGUF file name inside the model directory or hub repo")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default="contiguous",
                   help="contiguous | random:SEED | path to a dtp-layout/1 JSON file (default: contiguous)")
    p.add_argument("--devices", "-L", type=int, required=True, help="number of DTP devices L")
    p.add_argument("--delta", "-d", type=int, default=1, help="delay δ in modules (default: 1)")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from models.loading import ModelSource, load_model, load_tokenizer

    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    t0 = time.perf_counter()
    print(f"loading {args.model} …", file=sys.stderr)
    model = load_model(source, dtype=args.dtype, device=args.device)
    tokenizer = load_tokenizer(source)
    print(f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return model, tokenizer


def _layout(args: argparse.Namespace, model: Any) -> Any:
    from models.families import model_shape
    from models.layout import resolve

    return resolve(args.layout, model_shape(model.config), args.devices, args.delta)


def cmd_export(args: argparse.Namespace) -> int:
    from models.export import export_checkpoint, export_rank_shards, permuted_copy
    from models.families import model_shape
    from models.layout import check_delta, check_devices
    from models.loading import ModelSource, load_config

    config = load_config(ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file))
    check_devices(model_shape(config), args.devices)  # fail before loading weights
    check_delta(model_shape(config), args.delta)
    model, tokenizer = _load(args)
    layout = _layout(args, model)
    permuted = permuted_copy(model, layout)
    out = Path(args.out)
    ckpt = export_checkpoint(permuted, layout, out / "checkpoint", tokenizer=tokenizer,
                             overwrite=args.overwrite)
    shards = export_rank_shards(permuted, layout, out / "shards", tokenizer=tokenizer,
                                overwrite=args.overwrite, progress=_progress_bar())
    print(f"layout {layout.name}: L={layout.devices} δ={layout.delta}")
    print(f"permuted checkpoint: {ckpt}")
    print(f"rank shards:         {shards} ({layout.devices} files + manifest.json)")
    return 0


def _eval_result(args: argparse.Namespace, model: Any, tokenizer: Any) -> Any:
    from models.calibration import CalibrationSpec, load_blocks
    from models.evaluate import evaluate

    layout = _layout(args, model)
    spec = CalibrationSpec(source=args.data, sequences=args.blocks, seq_len=args.seq_len, seed=0,
                           text_field=args.text_field)
    blocks = load_blocks(spec, tokenizer, vocab_size=model.config.vocab_size)
    return evaluate(model, layout, blocks, batch_size=args.batch_size, last_scale=args.last_scale,
                    progress=_progress_bar())


def cmd_eval(args: argparse.Namespace) -> int:
    model, tokenizer = _load(args)
    result = _eval_result(args, model, tokenizer)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"layout {result.layout}  L={result.devices} δ={result.delta}  "
              f"{result.blocks} blocks × {result.seq_len} tokens")
        print(f"  dense perplexity   {result.dense_ppl:10.3f}")
        print(f"  DTP perplexity     {result.dtp_ppl:10.3f}")
        print(f"  KL(dense ‖ DTP)    {result.kl:10.4f} nats/token")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Evaluate contiguous and random layouts of the packaged SmolLM2-135M on the corpus."""
    from models.assets import corpus_file, smollm2_gguf

    gguf, data = smollm2_gguf(), corpus_file("kjv")
    print(f"demo: SmolLM2-135M ({gguf.name}), L=3, δ=1, {args.blocks} blocks × {args.seq_len} tokens of {data}")
    ns = argparse.Namespace(model=str(gguf), revision=None, gguf_file=None, dtype="float32",
                            device=args.device, devices=3, delta=1, data=str(data), blocks=args.blocks,
                            seq_len=args.seq_len, text_field="text", batch_size=1, last_scale="sqrt")
    model, tokenizer = _load(ns)
    print(f"{'layout':<14}{'dense ppl':>12}{'DTP ppl':>12}{'KL nats/tok':>14}")
    for layout in ("contiguous", "random:1000", "random:1001"):
        ns.layout = layout
        r = _eval_result(ns, model, tokenizer)
        print(f"{layout:<14}{r.dense_ppl:>12.3f}{r.dtp_ppl:>12.3f}{r.kl:>14.4f}")
    print("next: `dtp-layout export MODEL --layout random:1000 --devices 3 --delta 1 --out DIR`")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dtp-layout",
                                     description="Affinity-aware layouts for Delayed Tensor Parallelism")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="write the permuted HF checkpoint and per-rank DTP shards")
    _add_model_args(p)
    _add_layout_args(p)
    p.add_argument("--out", required=True, help="output directory (gets checkpoint/ and shards/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="dense and DTP perplexity and KL(dense ‖ DTP) on a data spec")
    _add_model_args(p)
    _add_layout_args(p)
    p.add_argument("--data", required=True,
                   help="text file, directory of .txt, .jsonl, .npy of token ids, corpus:kjv, hf:NAME[:CFG[:SPLIT]]")
    p.add_argument("--blocks", type=int, default=16, help="number of blocks (default: 16)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per block (default: 1024)")
    p.add_argument("--text-field", default="text", help="field of .jsonl / hf rows holding the text")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--last-scale", default="sqrt", choices=["sqrt", "one"],
                   help="own-scale of the last δ modules (default: sqrt, i.e. √L)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("demo", help="evaluate two layouts of the packaged SmolLM2-135M on the corpus")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_demo)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from models.assets import AssetNotFoundError
    from models.calibration import DataError
    from models.export import ExportError
    from models.families import UnsupportedModelError
    from models.layout import LayoutError
    from models.loading import ModelLoadError

    return (CliError, AssetNotFoundError, DataError, ExportError, UnsupportedModelError, LayoutError,
            ModelLoadError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except Exception as exc:
        if isinstance(exc, _user_errors()):
            print(f"dtp-layout {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise
    return code


if __name__ == "__main__":
    sys.exit(main())
