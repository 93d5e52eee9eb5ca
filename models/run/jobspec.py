"""A job's parameters, declared once: every field of a job spec with its kind, default, bounds, help and
command-line flags (models/base/fields.py's FieldRule, as the distillation recipe declares its own).

Generated from this table, never restated: the API's request models (app/core/schemas/jobs.py), the flags of
`dtp-layout optimise` and `distill` and of `dtp-layout client submit` (app/cli/args/spec_flags.py), and the
dashboard form's fields, choices and defaults (served by GET /v1/spec). `distill.recipe.*` are the
recipe's own rules (models/distill/recipe.py). tests/test_one_spec.py checks that every field reaches
each of them with the same default. Dependency-free: the API process imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from models.affinity.names import SCORES
from models.base.fields import NO_DEFAULT, FieldRule, Flag
from models.base.layout_format import LAYOUT_FORMAT
from models.distill.recipe import EVAL_SEQUENCES, SEQ_LEN, WIKITEXT2_TEST, DistillRecipe
from models.io.ids import DTYPE_NAMES, EXPORT_DTYPE_NAMES, GGUF_FILE, REVISION
from models.io.sizes import SIZE_PATTERN
from models.layouts.names import CONTIGUOUS, RANDOM_SEED_BASE
from models.probe.spec import MAX_CANDIDATES as MAX_PROBE_CANDIDATES
from models.probe.spec import PROBE_BATCH
from models.schedules.grammar import MAX_SCHEDULE_CHARS, accepted_forms

REQUIRED: Any = object()  # a SpecField's default when a request must give the field

INT32_MAX = 2**31 - 1  # seeds are stored in Integer columns (metrics.seed)
MAX_SKIP_BLOCKS = 1_000_000
MAX_SEQ_LEN = 1_048_576
MAX_WORLD_SIZE = 64  # ranks of a sharded distillation (a worker setting caps it lower: the GPUs any worker owns)

LOCAL = ("optimise", "distill", "export", "eval")  # every local command that loads a model
MODEL_COMMANDS = (*LOCAL, "submit")


@dataclass(frozen=True)
class SpecField:
    """One field of a job spec: its dotted path (`calibration.seq_len`), rule and default."""

    path: str
    rule: FieldRule
    default: Any = REQUIRED

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def group(self) -> str:
        """The block the field is in (`calibration`, `distill.recipe`), or "" for a top-level field."""
        return self.path.rpartition(".")[0]


@dataclass(frozen=True)
class SpecGroup:
    """A block of the spec: `model`, `calibration`, `export`, `distill`, `distill.train`, …"""

    path: str
    doc: str
    required: bool = False
    nullable: bool = False  # null (the default) leaves the block out: no distillation, default data
    flags: tuple[Flag, ...] = ()  # an `off` flag sets the whole block to false (`export: false`)


def _f(path: str, kind: str, doc: str, default: Any = REQUIRED, *flags: Flag, **rule: Any) -> SpecField:
    return SpecField(path, FieldRule(kind, doc, flags=flags, **rule), default)  # type: ignore[arg-type]


def _on(names: tuple[str, ...], *commands: str, **kw: Any) -> Flag:
    return Flag(names, commands, **kw)  # type: ignore[arg-type]


_SOURCE_DOC = ("corpus:shakespeare | corpus:kjv (both shipped with every install) | hf:OWNER/NAME[:CONFIG[:SPLIT]] "
               "(a hub dataset id) | upload:ID (the tenant's own data upload: POST /v1/uploads, `client upload`) | "
               "a name under the server's data root (.txt, "
               ".jsonl, .npy of token ids, or a directory of .txt)")
_TEXT_FIELD_DOC = "text field of .jsonl / hf rows"
# The schedule as a local command (optimise, distill, export, eval) takes it: no `null`, no service.
_LOCAL_SCHEDULE_DOC = (f"communication schedule: {accepted_forms(sep=' | ', auto=False)} (docs/method.md); default: "
                       f"dtp:δ of --delta (a dtp schedule and a different --delta are refused). What the layouts are "
                       f"evaluated and distilled under, and the shards exported for")
# `optimise` also takes spd:auto:K and spd:isolated:K: it runs the sensitivity pass that chooses their layers.
_OPTIMISE_SCHEDULE_DOC = (f"communication schedule: {accepted_forms(sep=' | ')} (docs/method.md; spd:auto:K: the K "
                          f"layers whose dropped sync costs least KL, chosen on the calibration blocks); default: "
                          f"dtp:δ of --delta (a dtp schedule and a different --delta are refused). What the layouts "
                          f"are evaluated and distilled under, and the shards exported for")


def _data(part: str, source_flags: tuple[Flag, ...], sequences_flags: tuple[Flag, ...],
          seq_len_flags: tuple[Flag, ...], skip_flags: tuple[Flag, ...]) -> list[SpecField]:
    """The fields of `distill.train` or `distill.eval`: one rule for both (one request model, DistillDataIn);
    only their flags differ."""
    p = f"distill.{part}"
    return [
        _f(f"{p}.source", "str", "corpus:shakespeare | corpus:kjv | hf:OWNER/NAME[:CONFIG[:SPLIT]] | upload:ID | a "
           "name under the server's data root", REQUIRED, *source_flags, min_length=1, max_length=300,
           examples=("corpus:shakespeare",)),
        _f(f"{p}.sequences", "int", "blocks to load; training: steps × batch_size (one pass), evaluation: "
           f"{EVAL_SEQUENCES}", None, *sequences_flags, ge=1, le=10_000_000, nullable=True),
        _f(f"{p}.seq_len", "int", "tokens per block; training: the calibration's seq_len, evaluation: the "
           "training's", None, *seq_len_flags, ge=2, le=MAX_SEQ_LEN, nullable=True),
        _f(f"{p}.text_field", "str", _TEXT_FIELD_DOC, "text",
           _on(("--text-field",), "distill", help="field of .jsonl / hf rows holding the text (training and "
                                                  "evaluation)"), min_length=1, max_length=100),
        _f(f"{p}.skip_blocks", "int", "blocks to skip at the start of the source", 0, *skip_flags,
           ge=0, le=MAX_SKIP_BLOCKS),
    ]


def _recipe_fields() -> list[SpecField]:
    """`distill.recipe.*`: the recipe's own rules and defaults (null or absent keeps the default)."""
    paper = DistillRecipe()
    return [SpecField(f"distill.recipe.{f.name}", replace(f.metadata["rule"], nullable=True), getattr(paper, f.name))
            for f in fields(DistillRecipe)]


GROUPS: tuple[SpecGroup, ...] = (
    SpecGroup("model", "the model to lay out", required=True),
    SpecGroup("calibration", "the calibration text (models/data/calibration.py); a file source is a name under the "
                             "data root", required=True),
    SpecGroup("export", "what to export for the optimised layout; `false` for nothing",
              flags=(Flag(("--no-export",), ("optimise", "submit"), form="off",
                          help="export nothing (no permuted checkpoint, no rank shards)"),)),
    SpecGroup("distill", "after the layouts (and the export): distil the DTP model of each named layout from the "
                         "dense one and record the curves (stage `distilling`)", nullable=True),
    SpecGroup("distill.train", "training text; default: the calibration source. Where it is the calibration's text "
                               "(by content), training starts after the calibration blocks", nullable=True),
    SpecGroup("distill.eval", "held-out evaluation text; default: the training source. Where it is the training or "
                              "calibration text (by content), evaluation starts after those blocks", nullable=True),
    SpecGroup("distill.recipe", "the training recipe; every field optional (the paper's defaults)"),
)

FIELDS: tuple[SpecField, ...] = (
    # ---- the model ----
    _f("model.id", "str", "a hub id `owner/name`, upload:ID (the tenant's own model upload: POST /v1/uploads, "
       "`client upload`), or a name under the server's model root (a checkpoint directory or a .gguf file)", REQUIRED,
       _on(("model",), *LOCAL, help="hub id (owner/name), a local checkpoint directory, or a local .gguf file"),
       _on(("--model",), "submit"), min_length=1, max_length=300, examples=("smollm2-135m", "Qwen/Qwen2.5-0.5B")),
    _f("model.revision", "str", "hub branch, tag or commit (hub models only)", None,
       _on(("--revision",), *MODEL_COMMANDS), max_length=128, pattern=REVISION.pattern, nullable=True),
    _f("model.gguf_file", "str", "a .gguf file inside the model directory or hub repo", None,
       _on(("--gguf-file",), *MODEL_COMMANDS), max_length=200, pattern=GGUF_FILE.pattern, nullable=True),
    _f("model.dtype", "choice", "compute dtype: what the weights are loaded and the passes run in (the export's "
       "dtype is export.dtype)", "float32", _on(("--dtype",), *MODEL_COMMANDS), choices=DTYPE_NAMES),
    _f("max_memory", "str", "memory limit of the run, e.g. 2GiB or 500MB: the affinity pass, the export and the "
       "evaluation stream the model layer by layer from its safetensors when it would not fit in memory, and a run "
       "that cannot fit even streamed is refused, naming what it needs; null: the worker's DTP_LAYOUT_MAX_MEMORY "
       "(no limit unless set)", None,
       _on(("--max-memory",), "optimise", "export", "eval", metavar="SIZE",
           help="memory limit of the run, e.g. 2GiB or 500MB: the affinity pass, the export and the evaluation "
                "stream the model layer by layer from its safetensors when it would not fit in memory, and a run "
                "that cannot fit even streamed is refused, naming what it needs (default: no limit)"),
       _on(("--max-memory",), "submit", metavar="SIZE"), max_length=32,
       pattern=SIZE_PATTERN, nullable=True, examples=("2GiB",)),
    # ---- the layout problem ----
    _f("devices", "int", "number of DTP devices L (must divide the KV groups and the FFN width)", REQUIRED,
       _on(("--devices", "-L"), *MODEL_COMMANDS), ge=1, le=1024),
    _f("delta", "int", "delay δ in modules", 1, _on(("--delta", "-d"), *MODEL_COMMANDS), ge=0, le=1024),
    _f("schedule", "str", f"communication schedule: {accepted_forms(sep=' | ')} (docs/method.md; spd:auto:K: the "
       f"job's affinity stage chooses the K layers); null: dtp:δ of delta, which stays its shorthand (a dtp schedule "
       f"and a different delta are refused). What the layouts are evaluated and distilled under, and the shards "
       f"exported for",
       None, _on(("--schedule",), "distill", "export", "eval", metavar="S", help=_LOCAL_SCHEDULE_DOC),
       _on(("--schedule",), "optimise", metavar="S", help=_OPTIMISE_SCHEDULE_DOC),
       _on(("--schedule",), "submit", metavar="S"),
       min_length=1, max_length=MAX_SCHEDULE_CHARS, nullable=True, examples=("dtp:1", "pt:2", "spd:1,3")),
    # ---- calibration ----
    _f("calibration.source", "str", _SOURCE_DOC, REQUIRED,
       _on(("--calib",), "optimise", metavar="SOURCE",
           help="calibration text: a local .txt file, .jsonl (--text-field), .npy of token ids or directory of "
                ".txt files, corpus:shakespeare or corpus:kjv (both shipped with every install) or "
                "hf:OWNER/NAME[:CONFIG[:SPLIT]] (a hub dataset, with the hf extra)"),
       _on(("--calib",), "submit"),
       min_length=1, max_length=300, examples=("corpus:shakespeare", "calibration/tokens.npy")),
    _f("calibration.sequences", "int", "calibration blocks; sequences × seq_len is bounded by the server's "
       "DTP_LAYOUT_MAX_CALIBRATION_TOKENS", 64,
       _on(("--calib-sequences",), "optimise", help="calibration blocks (sequences × seq_len tokens are read)"),
       _on(("--calib-sequences",), "submit"),
       ge=1, le=1_000_000),
    _f("calibration.seq_len", "int", "tokens per block; at most the model's max_position_embeddings", 1024,
       _on(("--calib-seq-len",), "optimise", "submit"), ge=2, le=MAX_SEQ_LEN),
    _f("calibration.seed", "int", "block-order seed", 0, _on(("--calib-seed",), "optimise", "submit"),
       ge=0, le=INT32_MAX),
    _f("calibration.text_field", "str", _TEXT_FIELD_DOC, "text", _on(("--text-field",), "optimise"),
       min_length=1, max_length=100),
    _f("calibration.skip_blocks", "int", "blocks to skip at the start of the stream (skip_blocks × seq_len is "
       "bounded by DTP_LAYOUT_MAX_SKIP_TOKENS)", 0,
       _on(("--calib-skip-blocks",), "optimise", help="blocks to skip at the start of the calibration text"),
       _on(("--calib-skip-blocks",), "submit"),
       ge=0, le=MAX_SKIP_BLOCKS),
    # ---- what is optimised and scored ----
    _f("score", "choice", "up-edge affinity score", "fo", _on(("--score",), "optimise", "submit"), choices=SCORES),
    _f("random_layouts", "int", f"K random layouts scored as baselines ({CONTIGUOUS} is always scored; seeds "
       f"{RANDOM_SEED_BASE}…)", 0, _on(("--random",), "optimise", "submit", metavar="K"), ge=0, le=64),
    _f("ablations", "bool", "also the paper's seven spread layouts (§5.4): anti-optimised, heads-only, "
       "neurons-only, add-score (fo-score for score=add), 4-, 8- and 12-layers, and optimised-restarts-0 when "
       "restarts > 0", False, _on(("--ablations",), "optimise", "submit", form="on")),
    _f("restarts", "int", "extra optimiser starts from random head assignments (0 is the paper's procedure: one "
       "start from the contiguous KV groups)", 4, _on(("--restarts",), "optimise", "submit"), ge=0, le=64),
    _f("batch_size", "int", "calibration sequences per micro-batch", 4,
       _on(("--batch-size",), "optimise", "submit"), ge=1, le=1024),
    _f("stability", "bool", "also optimise on each half of the calibration blocks and report how the two layouts "
       "score on the other half and how much they agree (report.json `stability`)", False,
       _on(("--stability",), "optimise", "submit", form="on")),
    # ---- the training probe (models/probe) ----
    _f("probe", "int", "choose the job's layout by a short training probe among this many candidate layouts (the "
       "schedule's J_σ-optimised, the dtp:1-optimised, mixtures of their objectives, optimiser restarts): each is "
       "distilled probe_steps steps on the calibration blocks and the lowest KL on held-out calibration text wins "
       "and is exported (report.json `probe`); 0: no probe, the J_σ-optimised layout", 0,
       _on(("--probe",), "optimise", "submit", metavar="K"), ge=0, le=MAX_PROBE_CANDIDATES),
    _f("probe_steps", "int", f"distillation steps of each probe candidate ({PROBE_BATCH} calibration blocks a step)",
       20, _on(("--probe-steps",), "optimise", "submit", metavar="S"), ge=1, le=10_000),
    _f("probe_eval_sequences", "int", "held-out blocks (of calibration.seq_len tokens, the calibration text after "
       "the blocks the probe trains on) each probe candidate's KL is measured on", 16,
       _on(("--probe-eval-sequences",), "optimise", "submit", metavar="N"), ge=1, le=4096),
    _f("probe_max_seconds", "int", "the probe's time budget: before it trains, its time is estimated from one "
       "measured step, and a probe estimated over this is refused", 3600,
       _on(("--probe-max-seconds",), "optimise", "submit", metavar="S"), ge=1, le=7 * 86_400),
    # ---- export ----
    _f("export.checkpoint", "bool", "the permuted Hugging Face checkpoint (checkpoint/*)", True,
       _on(("--no-checkpoint",), "submit", form="off", help="no permuted checkpoint")),
    _f("export.shards", "bool", "per-rank DTP shards and manifest (shards/*)", True,
       _on(("--no-shards",), "submit", form="off", help="no rank shards")),
    _f("export.dtype", "choice", "dtype the exported weights are stored in; auto: the source checkpoint's (a bf16 "
       "hub model exports bf16 whatever model.dtype computed in; a GGUF, which has none, exports in model.dtype). "
       "The manifest records both", "auto", _on(("--export-dtype",), "optimise", "export", "submit"),
       choices=EXPORT_DTYPE_NAMES),
    # ---- distillation ----
    _f("distill.layouts", "list", "layouts of this job to distil: optimised, contiguous, random-<seed> "
       f"(random-{RANDOM_SEED_BASE} … with random_layouts), and the ablations with ablations=true",
       ("optimised", CONTIGUOUS),
       _on(("--layouts",), "distill", form="csv",
           help="comma-separated: names from --from DIR/layouts (optimised, anti-optimised, heads-only, …), "
                f"{CONTIGUOUS}, random-SEED / random:SEED, or {LAYOUT_FORMAT} JSON paths"),
       _on(("--distill",), "submit", form="csv", metavar="LAYOUTS"),
       min_length=1, max_length=16, item=FieldRule("str", "a layout name", min_length=1, max_length=64)),
    _f("distill.seeds", "list", "training seeds; each (layout, seed) pair is one run", (0,),
       _on(("--seeds",), "distill", form="csv"), _on(("--distill-seeds",), "submit", form="csv", metavar="S,S"),
       min_length=1, max_length=16, item=FieldRule("int", "a seed", ge=0, le=INT32_MAX)),
    _f("distill.steps", "int", "optimiser steps per run (shorthand for recipe.steps; "
       f"{DistillRecipe().steps})", None, _on(("--distill-steps",), "submit", metavar="N"),
       ge=1, le=10_000_000, nullable=True),
    *_data("train",
           source_flags=(_on(("--data",), "distill", help="training data: text file, directory of .txt, .jsonl, "
                                                          ".npy of ids, corpus:NAME, hf:OWNER/NAME[:CONFIG[:SPLIT]]"),
                         _on(("--train-data",), "submit", metavar="SOURCE")),
           sequences_flags=(_on(("--train-sequences",), "distill", help="training blocks to load (default: steps × "
                                                                        "batch size, one pass); fewer repeat in "
                                                                        "seeded epochs"),),
           seq_len_flags=(_on(("--seq-len",), "distill", default=SEQ_LEN,
                              help="tokens per training block (a local run has no calibration to follow)"),),
           skip_flags=(_on(("--train-skip-blocks",), "distill"),)),
    *_data("eval",
           source_flags=(_on(("--eval-data",), "distill", default=WIKITEXT2_TEST,
                             help="held-out evaluation data (a local run: WikiText-2's test split, which needs "
                                  "`datasets` and the internet); skips past the training and calibration text when "
                                  "it is the same text"),
                         _on(("--eval-data",), "submit", metavar="SOURCE")),
           sequences_flags=(_on(("--eval-blocks",), "distill", default=EVAL_SEQUENCES),),
           seq_len_flags=(_on(("--eval-seq-len",), "distill"),),
           skip_flags=()),
    _f("distill.world_size", "int", "ranks (processes; one GPU each where there are GPUs) the distillation trains on: "
       "the student sharded with FSDP2, each rank a 1/W share of every batch, the same curve as 1 (recipe.batch_size "
       "must be a multiple). A job waits for a worker with at least this many GPUs (CPU workers: gloo processes)",
       1, _on(("--world-size",), "distill", "submit", metavar="W"), ge=1, le=MAX_WORLD_SIZE),
    _f("distill.allow_overlap", "bool", "read train and eval as given even where they overlap the calibration or "
       "each other (the overlap is reported in summary.json and report.json under `data`)", False,
       _on(("--allow-overlap",), "distill", "submit", form="on")),
    *_recipe_fields(),
)

BY_PATH: dict[str, SpecField] = {f.path: f for f in FIELDS}
GROUP_BY_PATH: dict[str, SpecGroup] = {g.path: g for g in GROUPS}


def group_fields(group: str) -> dict[str, SpecField]:
    """The fields directly in a block (`calibration` → source, sequences, …; "" → devices, delta, …)."""
    return {f.name: f for f in FIELDS if f.group == group}


def flags_of(command: str) -> list[tuple[SpecField, Flag]]:
    """Every (field, flag) of a command, in declaration order."""
    return [(f, flag) for f in FIELDS for flag in f.rule.flags_of(command)]


def command_default(field: SpecField, flag: Flag) -> Any:
    """What a local command uses when the flag is not given: the flag's declared default, else the field's."""
    return field.default if flag.default is NO_DEFAULT else flag.default
