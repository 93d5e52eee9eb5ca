"""The model commands' shared arguments and steps: the job spec's flags, where to run, the converted-GGUF
cache, loading the model (whole or streamed layer by layer), the layout named by --layout, and the progress
bars. Used by `export`, `eval`, `demo` (app/cli/commands/eval_export.py), `optimise` (app/cli/commands/optimise.py) and
`distill` (app/cli/commands/distill.py). Torch-free at import: every heavy module is imported inside a function.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.cli.args.spec_flags import add_spec_flags
from app.cli.errors import CliError
from models.base.layout_format import LAYOUT_FORMAT
from models.layouts.names import CONTIGUOUS


def progress_bar() -> Callable[[str, float], None]:
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


def add_model_args(p: argparse.ArgumentParser, command: str, *, groups: dict[str, Any] | None = None) -> None:
    """The command's flags of the job spec (the model, L, δ, and whatever else of the spec the command
    takes: models/run/jobspec.py declares which), then where to run."""
    add_spec_flags(p, command, groups=groups)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    add_convert_cache_flag(p)


def add_convert_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-convert-cache", action="store_true",
                   help="dequantise a GGUF model on every load instead of loading its converted copy from "
                        "$DTP_LAYOUT_CACHE_DIR/converted/ (made by the first load, reused by every later one)")


def converted_cache(args: argparse.Namespace) -> Any:
    """The models.io.converted.ConvertedCache a GGUF model is loaded through (its default place, namespace
    `local`), or None with --no-convert-cache."""
    if getattr(args, "no_convert_cache", False):
        return None
    from models.io.converted import ConvertedCache

    return ConvertedCache()


def model_config(args: argparse.Namespace, source: Any) -> Any:
    """The model's config, from its converted copy when there is one (parsing a GGUF's metadata takes
    seconds of its own), else from `source`."""
    from models.io.loading import ModelSource, load_config

    cache = converted_cache(args)
    copy = cache.lookup(source, dtype=args.dtype) if cache is not None else None
    return load_config(ModelSource(str(copy)) if copy is not None else source)


def export_dtype(args: argparse.Namespace, config: Any) -> Any:
    from models.export.files import export_dtype
    from models.io.loading import DTYPES

    return export_dtype(args.export_dtype, config=config, compute=DTYPES[args.dtype])


def add_stream_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stream", action="store_true",
                   help="read the model layer by layer from its safetensors even when it fits in memory (by "
                        "default it streams only when --max-memory is below what the in-memory run needs)")


def memory_plan(args: argparse.Namespace, config: Any, command: str, **kw: Any) -> Any:
    """How the command fits --max-memory (models.streaming.memory_plan), before any weight is read: a
    MemoryLimitError (exit 2) names what it needs and the limit."""
    from models.streaming.memory_plan import plan_memory

    limit = max_memory(args)
    plan = plan_memory(config, dtype=args.dtype, command=command, limit=limit,  # type: ignore[arg-type]
                       stream=True if getattr(args, "stream", False) else None, **kw)
    if limit is not None or plan.stream:
        print(f"memory: {plan.describe()}", file=sys.stderr)
    return plan


def max_memory(args: argparse.Namespace) -> int | None:
    from models.io.sizes import parse_size

    return parse_size(args.max_memory) if getattr(args, "max_memory", None) is not None else None


def weights(args: argparse.Namespace, config: Any, plan: Any) -> tuple[Any, Any]:
    """The model and its tokenizer as `plan` chose (models.streaming.weights.open_weights; None: loaded whole):
    read layer by layer from its safetensors when the plan streams, else loaded whole (timed on stderr)."""
    from models.io.loading import ModelSource
    from models.streaming.weights import open_weights

    source = ModelSource(args.model, revision=args.revision, gguf_file=args.gguf_file)
    whole = plan is None or not plan.stream
    t0 = time.perf_counter()
    if whole:
        print(f"loading {args.model} …", file=sys.stderr)
    opened = open_weights(source, config, plan=plan, dtype=args.dtype, device=args.device,
                          converted=converted_cache(args))  # a GGUF converted on its first load only
    if whole:
        print(f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return opened.model, opened.tokenizer


def add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", default=CONTIGUOUS,
                   help=f"{CONTIGUOUS} | random:SEED (or random-SEED) | a layout name of --from DIR (optimised, "
                        f"heads-only, …) | path to a {LAYOUT_FORMAT} JSON file (default: {CONTIGUOUS})")
    p.add_argument("--from", dest="from_dir", help="a `dtp-layout optimise` output directory (reads DIR/layouts/)")


def load_model(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model loaded whole and its tokenizer."""
    return weights(args, None, None)


def layouts_dir_of(args: argparse.Namespace) -> Path | None:
    """DIR/layouts of `--from DIR`, or None without --from."""
    if not getattr(args, "from_dir", None):
        return None
    layouts_dir = Path(args.from_dir) / "layouts"
    if not layouts_dir.is_dir():
        raise CliError(f"--from {args.from_dir}: no layouts/ directory (expected a `dtp-layout optimise` output)")
    return layouts_dir


def calibration_of(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The calibration spec (and the identity of its text) of the `--from` run, from its report.json:
    training and evaluation skip those blocks where they read the same text (models.data.heldout)."""
    from models.data.calibration import CalibrationSpec

    if not getattr(args, "from_dir", None):
        return None, None
    report_file = Path(args.from_dir) / "report.json"
    try:
        report = json.loads(report_file.read_text())
        calibration = CalibrationSpec(**report["calibration"])
    except FileNotFoundError:
        return None, None  # a layouts directory without a report: nothing known to hold out
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{report_file}: cannot read the calibration spec: {exc}") from exc
    identity = report.get("calibration_identity")
    return calibration, identity if isinstance(identity, str) else None


def layout_of(args: argparse.Namespace, config: Any) -> Any:
    """The layout named by --layout (see models.layouts.names) for a model of this config."""
    from models.families import model_shape
    from models.layouts.resolve import resolve_layout

    return resolve_layout(args.layout, shape=model_shape(config), devices=args.devices, delta=args.delta,
                          layouts_dir=layouts_dir_of(args))


def check_layout_numbers(config: Any, devices: int, delta: int, schedule: Any = None) -> None:
    """L, δ and the schedule (its string or parsed; None: dtp:δ) checked against the model's config (before any
    weights load), by the rules of a run's loading stage (models.run.rules.model_refusals)."""
    from models.families import model_shape
    from models.run.rules import RunFacts, job_schedule, model_refusals, raise_first

    facts = RunFacts(devices=devices, delta=delta, schedule=job_schedule(schedule, delta), optimises=False)
    raise_first(model_refusals(facts, model_shape(config)))
