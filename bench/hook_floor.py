"""The floor under the addon in P2: mitmdump with a stub addon that answers every request itself, against plain
passthrough on the same load (`concurrency.py`: 256 agents, 10 turns, a backend answering after 100 ms).

The stub (`bench/stub_answer.py`) answers from the `request` hook, as the addon does, either at once (`sync`) or
after waiting as long as the backend would (`async`); it makes no upstream call. Its CPU per turn against
passthrough's says what mitmproxy's own upstream leg costs: the most that letting mitmproxy forward the addon's
request could save.

    .venv/bin/python bench/hook_floor.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from concurrency import measured_load  # noqa: E402
from local_servers import BackendProcess, PlainMitmdump  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    backend = BackendProcess(0.1)
    try:
        script = ("-s", str(BENCH / "stub_answer.py"))
        configurations = [("passthrough", (), None)] + [
            (f"stub {mode}", script, {"TITO_FLOOR_MODE": mode}) for mode in ("sync", "async")
        ]
        for _ in range(args.rounds):
            for name, extra_args, env in configurations:
                proxy = PlainMitmdump(backend.url, extra_args=extra_args, env=env)
                try:
                    run = measured_load([proxy.url], [proxy.proc.pid], 256, 10)
                finally:
                    proxy.stop()
                print(f"{name:12}  {run['proxy_cpu_ms_per_turn']:.3f} ms CPU a turn, {run['turns_per_s']:.0f} turns/s")
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
