"""Runs of the schedule experiment kept in the repository while a schedule's set is unfinished.

A schedule's 15 runs can outlast a session, and this machine's `var/` does not outlive one. `keep` copies every
finished run of a schedule (its `metrics.json` and `secondary.json`, which the experiment reads back and skips)
into docs/schedule_runs/in_progress/<schedule>-<steps>steps/, with the sha256 of each layout's placement they
trained. The
experiment restores them before it trains (`restore_kept`, called by `Experiment.train`): a kept run whose layout file
differs from the one the experiment has just built is refused, naming it, so a run is never counted for a layout
it did not train. Every layout file of the set is kept too (gzipped), trained or not, and a work directory that has
no layouts of the schedule yet starts from them (`restore_layouts`): another machine's affinity pass can differ in
its last bits, and that can move the optimiser to another placement, which would leave the kept runs refused and
the set's remaining runs training other layouts.

    .venv/bin/python -m bench.schedule_experiment keep --schedules "dtp:1" --steps 200 --work var/exp-200
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

from bench.schedule_verdicts import RUNS_DIR, runs_file, slug

KEPT_DIR = RUNS_DIR / "in_progress"
KEPT_FILES = ("metrics.json", "secondary.json")  # what the experiment reads of a finished run
LAYOUTS_FILE = "layouts.json"  # {layout name: sha256 of its file}
KEPT_LAYOUTS = "layouts"  # every layout file of the set, as <name>.json.gz


def kept_dir(schedule: str, steps: int, root: Path = KEPT_DIR) -> Path:
    return root / runs_file(root, schedule, steps).stem


PLACEMENT = ("devices", "delta", "schedule", "kv_group_device", "neuron_device")  # what a layout is, not its score


def digest(path: Path) -> str:
    """sha256 of the layout's placement (its scores' last bits may differ on another machine's affinity)."""
    layout = json.loads(path.read_text())
    return hashlib.sha256(json.dumps({k: layout.get(k) for k in PLACEMENT}, sort_keys=True).encode()).hexdigest()


def finished_runs(distill_dir: Path) -> list[Path]:
    """The run directories (runs/<layout>/seed-<n>) whose second domain is evaluated: finished runs."""
    return sorted(p.parent for p in (distill_dir / "runs").glob("*/seed-*/secondary.json"))


def keep(work: Path, schedule: str, steps: int, root: Path = KEPT_DIR) -> list[str]:
    """Copy the finished runs of `schedule` under `work` into its kept directory; their `layout/seed-n` names."""
    distill_dir, layouts = work / "distill" / slug(schedule), work / "layouts" / slug(schedule)
    out = kept_dir(schedule, steps, root)
    recorded = json.loads((out / LAYOUTS_FILE).read_text()) if (out / LAYOUTS_FILE).exists() else {}
    runs = finished_runs(distill_dir)
    if not runs:
        return []
    for path in sorted(layouts.glob("*.json")):  # the whole set: the runs still to train need it as well
        sha = digest(path)
        if recorded.setdefault(path.stem, sha) != sha:
            raise ValueError(f"{out}: layout {path.stem} was kept with another file ({recorded[path.stem][:12]}…, "
                             f"now {sha[:12]}…); remove the kept runs or keep them elsewhere")
        (out / KEPT_LAYOUTS).mkdir(parents=True, exist_ok=True)
        (out / KEPT_LAYOUTS / f"{path.name}.gz").write_bytes(gzip.compress(path.read_bytes(), mtime=0))
    names = []
    for run in runs:
        layout, seed = run.parent.name, run.name
        (out / "runs" / layout / seed).mkdir(parents=True, exist_ok=True)
        for name in KEPT_FILES:
            shutil.copyfile(run / name, out / "runs" / layout / seed / name)
        names.append(f"{layout}/{seed}")
    (out / LAYOUTS_FILE).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    return names


def restore_layouts(work: Path, schedule: str, steps: int, root: Path = KEPT_DIR) -> list[str]:
    """The kept set's layout files into `work`'s layouts of `schedule`, where it has none yet (a directory with
    layouts is used as it is, and `restore_kept` checks it against the kept runs); the names restored."""
    source = kept_dir(schedule, steps, root) / KEPT_LAYOUTS
    target = work / "layouts" / slug(schedule)
    if not source.is_dir() or any(target.glob("*.json")):
        return []
    target.mkdir(parents=True, exist_ok=True)
    names = []
    for packed in sorted(source.glob("*.json.gz")):
        (target / packed.name.removesuffix(".gz")).write_bytes(gzip.decompress(packed.read_bytes()))
        names.append(packed.name.removesuffix(".json.gz"))
    return names


def restore_kept(work: Path, schedule: str, steps: int, layouts: Path, root: Path = KEPT_DIR) -> list[str]:
    """Copy the kept runs of `schedule` into `work` where it has not finished them; ValueError naming the layout
    where a kept run's layout is not the file in `layouts`. Their `layout/seed-n` names."""
    source = kept_dir(schedule, steps, root)
    if not (source / LAYOUTS_FILE).exists():
        return []
    recorded = json.loads((source / LAYOUTS_FILE).read_text())
    names = []
    for run in finished_runs(source):
        layout, seed = run.parent.name, run.name
        path = layouts / f"{layout}.json"
        if not path.exists() or digest(path) != recorded.get(layout):
            raise ValueError(f"{source}: kept run {layout}/{seed} trained layout {layout} with sha256 "
                             f"{str(recorded.get(layout))[:12]}…, but {path} is "
                             f"{digest(path)[:12] + '…' if path.exists() else 'missing'}: not the same layout")
        target = work / "distill" / slug(schedule) / "runs" / layout / seed
        if (target / "secondary.json").exists():
            continue
        target.mkdir(parents=True, exist_ok=True)
        for name in KEPT_FILES:
            shutil.copyfile(run / name, target / name)
        names.append(f"{layout}/{seed}")
    return names
