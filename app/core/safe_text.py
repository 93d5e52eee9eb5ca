"""What a string from a request may hold, and how any string is written into a log line.

One rule for every string a request carries into the service (each field of a job spec, query
filters, key and tenant names): **only characters Python calls printable** (`str.isprintable`). That
refuses exactly the Unicode categories "Other" and "Separator" except the ASCII space:

- Cc: C0 controls (NUL, TAB, LF, CR, VT, FF, FS/GS/RS, ESC …), DEL and the C1 controls (U+0080–009F,
  NEL U+0085 among them);
- Cf: the bidi controls (U+202A–202E, U+2066–2069, U+200E/F, U+061C), the zero-width characters
  (U+200B–200D, U+2060, U+FEFF), the soft hyphen, invisible operators, tag characters …;
- Zl, Zp: U+2028 LINE SEPARATOR and U+2029 PARAGRAPH SEPARATOR;
- Zs other than U+0020: no-break and other spaces that look like a space and are not one;
- Cs, Co, Cn: lone surrogates (JSON can spell them), private-use and unassigned code points.

Why: such a character makes two names look alike that are not (a bidi override or a zero-width joiner
in a model id), breaks a log line (every line break `str.splitlines` knows is in Cc, Zl or Zp), or is
refused by Postgres (NUL). An accepted string is then NFC-normalised, so that the two spellings of
"é" (one code point, or e + a combining accent) are one name wherever names are compared.

Log lines (app/core/logs.py) use `for_log`: the same characters, written as escapes (`\\n`, `\\x85`,
`\\u2028`), so that nothing a client sends can start a line of its own or reorder one on screen.
"""

from __future__ import annotations

import unicodedata

# Every character str.splitlines() ends a line at (LF, VT, FF, CR, FS, GS, RS, NEL, LS, PS): none can
# reach a log line unescaped, whatever reads the log.
LINE_BREAKS = "\n\x0b\x0c\r\x1c\x1d\x1e\x85\u2028\u2029"
_SHORT_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def describe(char: str) -> str:
    """`U+202E RIGHT-TO-LEFT OVERRIDE` (or the category for characters without a name)."""
    name = unicodedata.name(char, "") or f"category {unicodedata.category(char)}"
    return f"U+{ord(char):04X} {name}"


def refusal(value: str) -> str | None:
    """Why `value` is refused (naming its first bad character and where it is), or None."""
    if value.isprintable():
        return None
    index, char = next((i, c) for i, c in enumerate(value) if not c.isprintable())
    return (f"must not contain control, format (bidi, zero-width), separator or unassigned characters: "
            f"{describe(char)} at position {index}")


def clean(value: str) -> str:
    """`value` NFC-normalised; ValueError naming the first character the rule refuses."""
    problem = refusal(value)
    if problem is not None:
        raise ValueError(problem)
    return unicodedata.normalize("NFC", value)


def nfc(value: str) -> str:
    return unicodedata.normalize("NFC", value)


def _escape(char: str, keep: str) -> str:
    if char.isprintable() or char in keep:
        return char
    code = ord(char)
    if char in _SHORT_ESCAPES:
        return _SHORT_ESCAPES[char]
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def for_log(value: str, *, keep: str = "") -> str:
    """`value` with every character the rule refuses written as an escape (`\\n`, `\\x85`, `\\u202e`):
    one line whatever it held. `keep` lists characters to leave alone (ESC for a formatter's colours,
    never line breaks). Fast on the common case: a printable string is returned as it is."""
    if value.isprintable():
        return value
    return "".join(_escape(c, keep) for c in value)


def json_escapes(text: str) -> str:
    """JSON text with every non-printable character inside its strings written as `\\uXXXX` (a
    surrogate pair above U+FFFF). `json.dumps(ensure_ascii=False)` escapes only C0: it writes DEL, the
    C1 controls (NEL), U+2028/2029 and the bidi controls raw, and a reader splitting on Unicode line
    breaks would see two lines. Outside strings a JSON text holds only printable ASCII."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        if char.isprintable():
            out.append(char)
            continue
        code = ord(char)
        if code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
    return "".join(out)
