"""What a test's mitmdump start costs (issue 42): `mitmdump -s tito_addon/__init__.py` started from scratch, as a
shell starts it, against the same command forked from the harness's warmed interpreter (`replicas/mitmdump_forks`),
interleaved, from `Popen`/fork to the "listening at" line, stopped (SIGTERM) after each.

    .venv/bin/python bench/mitmdump_starts.py [--starts 10]

Prints one JSON line per way: the median, lowest and highest seconds to listen, and the forked/fresh ratio. The
fork server's own start (its imports, once per pytest process) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.basics import tokenizer_path  # noqa: E402
from support.proxy_harness import Mitmdump  # noqa: E402

from tito_addon.replicas.mitmdump_forks import ForkedProcess, ForkServer  # noqa: E402


def start_once(forks: ForkServer | None, work: Path) -> float:
    Mitmdump.forks = forks
    proxy = Mitmdump("http://127.0.0.1:9", tokenizer=tokenizer_path("qwen3"), record_dir=work / "rec", cwd=work)
    began = time.perf_counter()
    proxy.start()
    took = time.perf_counter() - began
    assert isinstance(proxy.proc, ForkedProcess) == (forks is not None)
    proxy.stop()
    return took


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args()
    forks = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"})
    times: dict[str, list[float]] = {"fresh": [], "forked": []}
    with tempfile.TemporaryDirectory() as tmp:
        first = start_once(forks, Path(tmp))  # includes the server's imports
        print(json.dumps({"way": "fork server's first start", "s": round(first, 3)}), flush=True)
        for _ in range(args.starts):
            for way in ("fresh", "forked"):
                times[way].append(start_once(forks if way == "forked" else None, Path(tmp)))
    forks.close()
    medians = {way: statistics.median(taken) for way, taken in times.items()}
    for way, taken in times.items():
        row = {"way": way, "starts": len(taken), "median_s": round(medians[way], 3)}
        row |= {"min_s": round(min(taken), 3), "max_s": round(max(taken), 3)}
        print(json.dumps(row), flush=True)
    print(json.dumps({"forked_over_fresh": round(medians["forked"] / medians["fresh"], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
