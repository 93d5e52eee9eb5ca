"""The tokenizer's side files of a model upload, each kind with its own size cap, checked at completion
before a byte of them is read: every file the worker's `AutoTokenizer` may parse is one of these or
tokenizer.json (JSON_MAX_BYTES, loaded by `tokenizers` in the check), so none reaches the worker larger
than its kind's cap.

Why per kind (issue 41): a tokenizer_config.json naming a slow class (GPT2Tokenizer, BertTokenizer, a
sentencepiece one) makes transformers build the tokenizer in Python from vocab.json + merges.txt,
vocab.txt or tokenizer.model, holding ~28× the file in memory (an 80 MB merges.txt took the worker
495 → 2,681 MB). The caps are ~5× the largest real file of each kind (docs/security.md):

    vocabulary (vocab.json, merges.txt, vocab.txt, added_tokens.json)   TOKENIZER_VOCAB_MAX_BYTES (8 MiB)
    sentencepiece model (tokenizer.model)                              TOKENIZER_MODEL_MAX_BYTES (8 MiB)
    configuration (tokenizer_config.json, special_tokens_map.json,
                   chat_template.json, chat_template.jinja)           TOKENIZER_CONFIG_MAX_BYTES (4 MiB)

The text kinds (merges.txt, vocab.txt, chat_template.jinja) are read whole in the check and must be
UTF-8; the JSON kinds go through the bounded JSON reader like every other JSON file.
"""

from __future__ import annotations

from app.core.settings import Settings

# file name → the settings field capping it
SIDE_FILE_CAPS = {
    "vocab.json": "tokenizer_vocab_max_bytes", "merges.txt": "tokenizer_vocab_max_bytes",
    "vocab.txt": "tokenizer_vocab_max_bytes", "added_tokens.json": "tokenizer_vocab_max_bytes",
    "tokenizer.model": "tokenizer_model_max_bytes",
    "tokenizer_config.json": "tokenizer_config_max_bytes", "special_tokens_map.json": "tokenizer_config_max_bytes",
    "chat_template.json": "tokenizer_config_max_bytes", "chat_template.jinja": "tokenizer_config_max_bytes",
}
TEXT_FILES = frozenset({"merges.txt", "vocab.txt", "chat_template.jinja"})


def side_file_cap(settings: Settings, name: str) -> tuple[int, str] | None:
    """(bytes, variable) capping the side file `name`, or None when it is not a tokenizer side file."""
    field = SIDE_FILE_CAPS.get(name)
    return None if field is None else (getattr(settings, field), f"DTP_LAYOUT_{field.upper()}")


def size_problem(settings: Settings, name: str, size: int) -> str | None:
    """Why a side file of `size` bytes is refused (before it is read), or None."""
    cap = side_file_cap(settings, name)
    if cap is None or size <= cap[0]:
        return None
    return (f"is {size} bytes; a tokenizer's {name} is at most {cap[0]} bytes on this server ({cap[1]}): the "
            "worker would hold many times it in memory")


def text_problem(raw: bytes) -> str | None:
    """Why a text side file is not one the tokenizer reads, or None."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte {exc.start})"
    return None
