"""What the files issue 41 named cost the worker at the new caps, and how fast the completion check
refuses them past the caps.

1. The worker's parsers, each in a fresh process (its peak RSS from the kernel): `load_tokenizer` on a
   GPT2Tokenizer directory whose merges.txt is MiB large (the cap, TOKENIZER_VOCAB_MAX_BYTES = 8 MiB,
   and the issue's 80 MB); transformers' GGUF load of the tiny llama with N empty strings in one
   metadata array (the cap, GGUF_MAX_METADATA_ITEMS = 2^20, and smaller).
2. The completion check (`content_check`, what the check's child runs, in this process on a local
   store): the 80 MB merges.txt, one array of 2^21 empty strings (17 MB), and an extra 2^28-element
   Q2_K tensor declared in the tiny llama's table (its header; the 88 MB of data are not needed to
   refuse it).

    .venv/bin/python bench/parse_limits.py                          # merges 8 and 80 MiB; 2^17 and 2^20 strings
    .venv/bin/python bench/parse_limits.py --merges-mib 8 --strings 131072

One run, one machine: the figures are for the machine's load at the time.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _memory_mib(field: str) -> int:
    """VmRSS or VmHWM of this process (its own address space: getrusage's maxrss keeps the forked
    parent's across exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) >> 10


def merges_child(directory: str) -> dict:
    from models.io.loading import ModelSource, load_tokenizer

    before = _memory_mib("VmRSS")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(ModelSource(directory))
    return {"class": type(tokenizer).__name__, "seconds": round(time.perf_counter() - t0, 2),
            "rss_before_mib": before, "rss_peak_mib": _memory_mib("VmHWM")}


def gguf_child(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    before = _memory_mib("VmRSS")
    t0 = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    return {"seconds": round(time.perf_counter() - t0, 2), "rss_before_mib": before,
            "rss_peak_mib": _memory_mib("VmHWM")}


def in_child(kind: str, arg: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, arg], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def gpt2_directory(root: Path, mib: float) -> Path:
    directory = root / f"merges{mib:g}"
    directory.mkdir()
    (directory / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "a b\n" * int(mib * (1 << 20) / 4))
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    return directory


def strings_gguf(root: Path, tiny: Path, count: int) -> Path:
    from tests.models.test_gguf_tensors import rewrite

    return rewrite(tiny, root / f"strings{count}.gguf", arrays={"x.junk": [""] * count})


def completion_ms(root: Path, number: int, files: dict[str, bytes]) -> tuple[float, str]:
    """`content_check` of a model upload of `files` on a local store: ms and its first problem."""
    from app.core.errors import SpecError
    from app.core.services.upload_checks import content_check
    from app.core.settings import Settings
    from app.core.storage.root import Storage
    from app.core.storage.uploads import UploadStore

    store = UploadStore(Storage(root / "store"))
    prefix = f"uploads/bench/{number:032x}"
    for name, data in files.items():
        path = root / "store" / store.file_key(prefix, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    t0 = time.perf_counter()
    try:
        content_check(settings=Settings(var_dir=root / "var"), store=store, kind="model", prefix=prefix,
                      names=list(files))
        answer = "accepted"
    except SpecError as exc:
        answer = exc.problems[0][1]
    return (time.perf_counter() - t0) * 1e3, answer


def extra_tensor_header(tiny: Path) -> bytes:
    """The tiny llama's file with one more entry in its tensor table: a 2^28-element Q2_K tensor (88 MB
    of data, absent: its name is refused first). The entry is 64 bytes, twice the alignment, so every
    other tensor's data stays where its offset says."""
    from models.io.gguf_header import read_header

    data = tiny.read_bytes()
    header = read_header(data)
    name = b"blk.0.extra_junks.weight"
    entry = struct.pack("<Q", len(name)) + name + struct.pack("<I2QIQ", 2, 1 << 14, 1 << 14, 10, 0)
    assert len(entry) == 64 and header.scalars.get("general.alignment", 32) == 32
    count = struct.pack("<Q", len(header.tensors) + 1)
    return data[:8] + count + data[16:header.header_bytes] + entry + data[header.header_bytes:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--merges-mib", type=float, nargs="*", default=[8, 80])
    parser.add_argument("--strings", type=int, nargs="*", default=[1 << 17, 1 << 20])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, arg = args.child
        print(json.dumps(merges_child(arg) if kind == "merges" else gguf_child(arg)))
        return
    from tests.hostile_kit import TINY_CONFIG, WEIGHTS, gguf, gguf_array, gguf_string
    from tests.tiny import tiny_gguf

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = root / "tiny.gguf"
        tiny_gguf(tiny)
        print("1. the worker's parsers (fresh process each)")
        for mib in args.merges_mib:
            print(f"  merges.txt {mib:g} MiB, GPT2Tokenizer: {in_child('merges', str(gpt2_directory(root, mib)))}")
        for count in args.strings:
            measured = in_child("gguf", str(strings_gguf(root, tiny, count)))
            print(f"  GGUF with {count} empty metadata strings: {measured}")
        print("2. the completion check (in this process)")
        slow = {"config.json": json.dumps(TINY_CONFIG).encode(), "model.safetensors": WEIGHTS,
                "tokenizer_config.json": json.dumps({"tokenizer_class": "GPT2Tokenizer"}).encode(),
                "vocab.json": b'{"a": 0, "b": 1}', "merges.txt": b"#version: 0.2\n" + b"a b\n" * (20 << 20)}
        cases = {"80 MiB merges.txt": slow,
                 "2^21 empty strings (17 MB)": {"m.gguf": gguf([gguf_array("x.junk", 8, 1 << 21,
                                                                           gguf_string(b"") * (1 << 21))])},
                 "extra 2^28-element Q2_K tensor": {"m.gguf": extra_tensor_header(tiny)},
                 "the tiny llama GGUF": {"m.gguf": tiny.read_bytes()}}
        for number, (label, files) in enumerate(cases.items()):
            ms, answer = completion_ms(root, number, files)
            print(f"  {label}: {ms:.0f} ms: {answer[:160]}")


if __name__ == "__main__":
    main()
