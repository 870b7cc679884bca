"""JSON bytes from orjson wherever orjson writes the value the standard library would, else from the library.

orjson is several times faster, and the two read back alike except where orjson gives way: it writes a NaN or an
infinity as `null` where Python's `json` writes `NaN` (or refuses it), and it refuses an integer beyond 64 bits or
a key that is not a string. So output holding a `null` is read back and compared with the value (a non-finite
float reads back as None, and NaN differs even from itself), and whatever differs or is refused is written by the
standard library, with its own answer: NaN written, or a ValueError where `allow_nan` is off.

Reading back costs three times the write, so it is skipped where the nulls are all accounted for: when the output
holds exactly as many `null` as the object has members that are None (each writes one, which no neighbour can
overlap), no other value became one.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps_exact(value: Any, *, allow_nan: bool) -> bytes:
    """`value` as compact JSON (UTF-8, no escaped non-ASCII); ValueError for a non-finite float unless `allow_nan`."""
    try:
        out = orjson.dumps(value)
        nones = [*value.values()].count(None) if type(value) is dict else 0
        if out.count(b"null") == nones or orjson.loads(out) == value:
            return out
    except (TypeError, orjson.JSONEncodeError):
        pass
    return json.dumps(value, ensure_ascii=False, allow_nan=allow_nan, separators=(",", ":")).encode()
