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
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from concurrency import BackendProcess  # noqa: E402
from run_all import PlainMitmdump, measured_load  # noqa: E402


def stub(target: str, mode: str, port: int) -> subprocess.Popen[bytes]:
    mitmdump = Path(sys.executable).with_name("mitmdump")
    argv = [str(mitmdump), "--mode", f"reverse:{target}", "--listen-host", "127.0.0.1", "-p", str(port),
            "-s", str(BENCH / "stub_answer.py"), "--set", "flow_detail=0"]  # fmt: skip
    proc = subprocess.Popen(argv, env={**os.environ, "TITO_FLOOR_MODE": mode}, stdout=subprocess.DEVNULL)
    time.sleep(4)  # no listen line to wait for with stdout discarded; startup takes ~2 s here
    return proc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=18950)
    args = parser.parse_args()
    backend = BackendProcess(0.1)
    try:
        for _ in range(args.rounds):
            plain = PlainMitmdump(backend.url)
            try:
                run = measured_load([plain.url], [plain.proc.pid], 256, 10)
            finally:
                plain.stop()
            print(f"passthrough   {run['proxy_cpu_ms_per_turn']:.3f} ms CPU a turn, {run['turns_per_s']:.0f} turns/s")
            for mode in ("sync", "async"):
                proc = stub(backend.url, mode, args.port)
                try:
                    url = f"http://127.0.0.1:{args.port}"
                    run = measured_load([url], [proc.pid], 256, 10)
                finally:
                    proc.terminate()
                    proc.wait(20)
                cpu, rate = run["proxy_cpu_ms_per_turn"], run["turns_per_s"]
                print(f"stub {mode:6}   {cpu:.3f} ms CPU a turn, {rate:.0f} turns/s")
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
