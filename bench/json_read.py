"""Reading a chat request body: the strict stdlib parse (the reference) against `parse_json_object`, and the floor.

    .venv/bin/python bench/json_read.py [--turn 200] [--repeat 2000]

Bodies: the 345 KiB request of turn 200 of `p1_session.conversation` as Python's `json.dumps` writes it (spaced,
ASCII), the same written compact (as httpx, Node and serde_json clients send it), and a JSON-heavy variant whose
tool results hold escaped JSON and newlines, spaced and compact. Each is timed interleaved, the median of
`--repeat` runs. Spaced bodies go to the strict parse (see `json_body`), so they should read as before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from p1_session import conversation  # noqa: E402

from tito_addon.protocols.json_body import _parse_strict, parse_json_object  # noqa: E402


def bodies(turn: int) -> dict[str, bytes]:
    messages = conversation(turn)[-1]
    obj = {"model": "m", "messages": messages}
    escaped = [dict(m, content=m["content"].replace(" row", "\nrow").replace("=ok", '={"ok": true}')) for m in messages]
    return {
        "spaced": json.dumps(obj).encode(),
        "compact": json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode(),
        "json-heavy": json.dumps({"model": "m", "messages": escaped}).encode(),
        "json-heavy compact": json.dumps({"model": "m", "messages": escaped}, separators=(",", ":")).encode(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turn", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    for name, body in bodies(args.turn).items():
        assert parse_json_object(body) == _parse_strict(body)
        runs: dict[str, list[float]] = {"strict": [], "parse_json_object": [], "orjson.loads": []}
        calls = {"strict": _parse_strict, "parse_json_object": parse_json_object, "orjson.loads": orjson.loads}
        for _ in range(args.repeat):
            for what, call in calls.items():
                start = time.perf_counter()
                call(body)
                runs[what].append(time.perf_counter() - start)
        line = "  ".join(f"{what} {statistics.median(t) * 1e3:.3f} ms" for what, t in runs.items())
        print(f"{name:18s} {len(body) / 1024:6.1f} KiB  {line}")


if __name__ == "__main__":
    main()
