"""`hf:` sources offline, through the code that reads a hub dataset: a small dataset written into a
temporary Hugging Face datasets cache (the layout a dataset loaded once leaves behind), read with the
hub offline by `app.core.services.sources` + `models.data.calibration` (text field, split, streaming)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="hf: sources need the `datasets` extra (pip install -e '.[hf]')")

REPO = Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, shutil, sys
from pathlib import Path

root = Path(sys.argv[1])
# 1. The cache a hub dataset `dtp/tiny-text` (config `wiki`, splits train/test, text in `body`) leaves:
#    prepared by the same builder the hub path runs (json), then placed under the name the hub path
#    looks up offline: <cache>/dtp___tiny-text/wiki/0.0.0/<hash>/.
src = root / "src"
src.mkdir()
for split in ("train", "test"):
    with (src / f"{split}.jsonl").open("w") as f:
        for i in range(40):
            f.write(json.dumps({"body": f"{split} document {i}: " + "abcdefgh " * 10, "id": i}) + "\n")
from datasets.packaged_modules.json.json import Json

builder = Json(cache_dir=str(root / "build"), dataset_name="tiny-text", config_name="wiki",
               data_files={s: str(src / f"{s}.jsonl") for s in ("train", "test")})
builder.download_and_prepare()
target = root / "datasets" / "dtp___tiny-text" / "wiki" / "0.0.0" / "0123456789abcdef"
target.parent.mkdir(parents=True)
shutil.move(builder.cache_dir, target)

# 2. Read it as a job or a command would.
import datasets
# Recorded in a file: the text is read in the tokenizer's child process (models.io.sandbox), not here.
calls_file = root / "calls.jsonl"
load = datasets.load_dataset
def recording(*args, **kwargs):
    result = load(*args, **kwargs)
    with calls_file.open("a") as f:
        f.write(json.dumps({"args": list(args), "kwargs": kwargs, "type": type(result).__name__}) + "\n")
    return result
datasets.load_dataset = recording

from app.core.services.sources import resolve_data
from models.data.calibration import CalibrationSpec, DataError, load_blocks

class Bytes:  # a tokenizer: one id per byte, EOS 0
    eos_token_id = 0
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}

out = {}
for split in ("train", "test"):
    source = resolve_data(root, f"hf:dtp/tiny-text:wiki:{split}", field="distill.eval.source")
    blocks = load_blocks(CalibrationSpec(source, sequences=3, seq_len=32, text_field="body"), Bytes())
    rows = [bytes(int(t) for t in row if t).decode() for row in blocks.tolist()]
    out[split] = rows
try:
    load_blocks(CalibrationSpec("hf:dtp/tiny-text:wiki:test", sequences=1, seq_len=8), Bytes())
except DataError as exc:
    out["default_field"] = str(exc)
try:
    load_blocks(CalibrationSpec("hf:dtp/not-cached", sequences=1, seq_len=8), Bytes())
except DataError as exc:
    out["missing"] = str(exc)
out["calls"] = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
print(json.dumps(out))
"""


def test_hf_source_reads_a_cached_hub_dataset_offline(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DTP_LAYOUT_"))}
    env.update(PYTHONPATH=str(REPO), HF_HOME=str(tmp_path / "home"), HF_DATASETS_CACHE=str(tmp_path / "datasets"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the split and the text field: the blocks (seed-shuffled) are the start of that split's `body` text
    assert any(b.startswith("train document 0: abcdefgh") for b in out["train"]) and "test" not in str(out["train"])
    assert any(b.startswith("test document 0: abcdefgh") for b in out["test"]) and "train" not in str(out["test"])
    # streamed: one streaming load per read, an IterableDataset, never a download-and-prepare of the whole set
    assert out["calls"] and all(c["kwargs"].get("streaming") is True and c["type"] == "IterableDataset"
                                for c in out["calls"])
    assert out["calls"][0]["args"] == ["dtp/tiny-text", "wiki"] and out["calls"][0]["kwargs"]["split"] == "train"
    assert "rows have no string field 'text'" in out["default_field"]
    assert out["missing"].startswith("hf:dtp/not-cached: cannot load dataset 'dtp/not-cached'")
