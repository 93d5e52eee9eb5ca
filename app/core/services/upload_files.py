"""What an upload may hold: the file names and kinds a model or data upload accepts, and why any other
is refused. Dependency-free (the API, the client and the worker read it).

A model upload is a Hugging Face checkpoint directory's top level (config.json, *.safetensors, an
optional *.safetensors.index.json and the tokenizer's files) or one .gguf file; a data upload is one
.jsonl or .npy (token ids) file, or .txt files (read as a directory of text). Names are plain file
names: no directory part, no `..`, no leading dot. Pickled weights are refused by name, whatever the
rest of the upload holds.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

from models.io.ids import UPLOAD_REF

UploadKind = Literal["model", "data"]
UPLOAD_KINDS: tuple[UploadKind, ...] = get_args(UploadKind)
UPLOAD_ID = re.compile(r"^[0-9a-f]{32}$")
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,199}$")
UPLOAD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=@ -]{0,99}$")
MAX_FILES = 256
MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib")
# The tokenizer's and the checkpoint's side files a model directory may hold besides config.json and weights.
MODEL_SIDE_FILES = frozenset({
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "chat_template.jinja",
    "chat_template.json", "README.md", "LICENSE", "LICENSE.txt"})
DATA_SUFFIXES = (".txt", ".jsonl", ".npy")


def ref_id(source: str) -> str | None:
    """The upload id of `upload:<id>`, or None when `source` names no upload."""
    match = UPLOAD_REF.fullmatch(source)
    return match.group(1) if match else None


def name_problem(name: str) -> str | None:
    """Why `name` is not a file name an upload may hold (any kind), or None."""
    if not FILE_NAME.fullmatch(name):
        return (f"{name[:120]!r} is not a plain file name (letters, digits, '._+=@-', at most 200 characters, "
                "not starting with '.'; no directory part, no '..')")
    if name.lower().endswith(PICKLE_SUFFIXES):
        return (f"{name!r} is a pickle ({', '.join(PICKLE_SUFFIXES)}): refused, pickles run code when loaded; "
                "convert the weights to .safetensors")
    return None


def model_file_problem(name: str) -> str | None:
    if name == "config.json" or name in MODEL_SIDE_FILES or name.endswith((".safetensors", ".safetensors.index.json",
                                                                             ".gguf")):
        return None
    return (f"{name!r} is not a file a model upload holds (config.json, *.safetensors, *.safetensors.index.json, "
            "the tokenizer's files, or one .gguf)")


def data_file_problem(name: str) -> str | None:
    if name.endswith(DATA_SUFFIXES):
        return None
    return f"{name!r} is not a data file (.txt, .jsonl, or .npy of token ids)"


def layout_problem(kind: str, names: list[str]) -> str | None:
    """Why these files together are not one model or one data source, or None."""
    if kind == "model":
        ggufs = [n for n in names if n.endswith(".gguf")]
        if ggufs:
            return None if len(names) == 1 else "a .gguf model upload is that one file alone"
        if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            return "a model upload needs config.json and at least one .safetensors file (or one .gguf file)"
        return None
    single = [n for n in names if n.endswith((".jsonl", ".npy"))]
    if single and len(names) > 1:
        return "a .jsonl or .npy data upload is that one file alone (several files must all be .txt)"
    return None


def file_problem(kind: str, name: str) -> str | None:
    """Why `name` may not be in an upload of `kind`, or None."""
    return name_problem(name) or (model_file_problem(name) if kind == "model" else data_file_problem(name))


def part_count(size: int, part_size: int) -> int:
    """Parts of a file of `size` bytes (an empty file is one empty part)."""
    return max(1, -(-size // part_size))


def part_length(size: int, part_size: int, number: int) -> int:
    """Bytes of part `number` (1-based): `part_size`, the remainder for the last."""
    return min(part_size, size - (number - 1) * part_size)
