"""P2's work per turn in instructions: a whole proxy process (the addon, or plain mitmdump passthrough) under callgrind.

P2's turns/s move by ±20 % between runs on a shared machine, and its CPU per turn by ±10 %; instructions do not move.
This runs one proxy process under `valgrind --tool=callgrind` against the P2 backend and counts what it executes
over exactly the measured turns (a warm-up first, then `callgrind_control --dump` before and after P2's agents), so
start-up and the tokenizer load are left out and mitmproxy's own handling of each flow is in. Callgrind counts user
space only: the kernel's share of a turn (the sockets, the record file) is not in it.

    .venv/bin/python bench/proxy_instructions.py addon|passthrough [--agents 128] [--repo PATH]   # ~8 min each

Several can run at once (the counts do not depend on the machine's load): `bench/run_all.py --only p2i` runs
passthrough, the addon and the addon "before" side by side.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from concurrency import run_load, warm_up  # noqa: E402
from local_servers import BackendProcess  # noqa: E402

from tito_addon.replicas.proxy_process import Mitmdump  # noqa: E402

TOKENIZER = REPO.parent / "shared" / "tokenizers" / "qwen3"


def instructions(dump: Path) -> int:
    found = re.search(r"^(?:summary|totals): (\d+)", dump.read_text(), re.MULTILINE)
    if found is None:
        raise RuntimeError(f"no totals in {dump}")
    return int(found.group(1))


def measure(proxy_kind: str, agents: int = 128, turns: int = 10, repo: Path = REPO) -> dict:
    """Instructions a turn of one proxy process (`addon` from `repo`, or `passthrough`) over P2's turns."""
    out = Path(tempfile.mkdtemp(prefix="tito-instructions-"))
    valgrind = ["valgrind", "--tool=callgrind", "--compress-strings=no", f"--callgrind-out-file={out}/cg.%p"]
    backend = BackendProcess(0.1)
    record_dir = Path(tempfile.mkdtemp(prefix="tito-instructions-rec-"))
    proxy = Mitmdump(backend.url, tokenizer=str(TOKENIZER), record_dir=record_dir, cwd=record_dir,
                     extra_args=["--set", "flow_detail=0"], launcher=valgrind, repo=repo)  # fmt: skip
    if proxy_kind == "passthrough":
        mitmdump = str(Path(sys.executable).with_name("mitmdump"))
        proxy.argv = [*valgrind, mitmdump, "--mode", f"reverse:{backend.url}", "--listen-host", "127.0.0.1", "-p", "0",
                      "--set", "flow_detail=0"]  # fmt: skip
    try:
        proxy.start(timeout=1800)  # the tokenizer loads ~50x slower under callgrind
        assert proxy.proc is not None
        pid = proxy.proc.pid

        def dump() -> Path:
            subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
            time.sleep(2)
            return max(out.glob(f"cg.{pid}.*"), key=lambda path: int(path.suffix[1:]))

        warm_up([proxy.url])
        dump()
        run = run_load([proxy.url], agents, turns)
        counted = instructions(dump())
    finally:
        proxy.stop()
        backend.close()
    per_turn = counted / run["turns"]
    return {"proxy": proxy_kind, "repo": str(repo), "turns": run["turns"], "instructions_per_turn": per_turn}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("proxy", choices=["addon", "passthrough"])
    parser.add_argument("--agents", type=int, default=128)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose addon runs (a 'before')")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    result = measure(args.proxy, args.agents, args.turns, args.repo)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.proxy} ({args.repo}): {result['turns']} turns, "
              f"{result['instructions_per_turn'] / 1e6:.3f} M instructions a turn")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
