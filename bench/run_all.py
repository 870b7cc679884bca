"""Benchmarks P1-P4 (issue 6), as ratios against baselines measured in the same run.

    .venv/bin/python bench/run_all.py [--turns 200] [--repeats 3] [--only p1,p2,p3] [--out bench/results.json]

P1  per-turn added latency vs history length: one session of N turns, each appending a ~500-token tool result,
    through mitmdump + addon against a zero-latency backend, minus plain mitmdump reverse passthrough of the
    same requests (and minus direct); plus the naive baseline's cost: re-rendering and re-tokenizing the whole
    history every turn.
P2  concurrency: 256 agents x 10 turns, 100 ms backend latency: turns/s and p50/p99 latency through the addon
    vs plain mitmdump passthrough vs direct, and with N mitmdump processes (bench/concurrency.py).
P2i P2's turns in instructions a turn, a whole proxy process under callgrind (bench/proxy_instructions.py).
P3  memory per stored token: 1,000 sessions x 20k tokens in the session tree (ids only; logprobs live on disk).
P4  recording bytes per token for the N-turn session, vs the trajectory's own size (its final ids + logprobs).
P1s, P2f  the shared session store (Redis) against `memory`, and 1-3 proxies behind HAProxy (bench/fleet_bench.py).

The command line: which measurements run (`--only`), on which checkouts (`--before`), and where the results go. The
measurements themselves are `measurements.py`, `stream_bench.py` and `fleet_bench.py`, over the shared harness
(`p1_session.py`, `local_servers.py`, `concurrency.py`); none of them imports this module.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from local_servers import Backend  # noqa: E402
from measurements import TOKENIZER, p1_breakdown, p1_p4, p2, p2_instructions, p3, p5_run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--p2-rounds", type=int, help="P2's interleaved rounds (default: --repeats); P2 is the noisiest ratio and cheap"
    )
    parser.add_argument(
        "--only",
        default="p1,p2,p3,p5,p6,p2i,p1s,p2f",
        help="comma-separated: p1 (with p4), p2, p2i (P2 in instructions), p3, p5, p6, p1s, p2f",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results.json")
    parser.add_argument(
        "--before", metavar="REV", help="also run P1, P2 and P2i on this commit (a git worktree), for before/after"
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    before = checkout(args.before) if args.before else None
    try:
        results = run(args, only, before)
    finally:
        if before is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=False)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


def checkout(rev: str) -> Path:
    """`rev` in a temporary git worktree (removed after the run)."""
    path = Path(tempfile.mkdtemp(prefix="tito-before-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), rev], check=True,
                   capture_output=True)  # fmt: skip
    return path


def run(args: argparse.Namespace, only: set[str], before: Path | None) -> dict:
    results: dict = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "command": " ".join(sys.argv),
        "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip(),
    }  # fmt: skip
    if before is not None:
        results["before"] = subprocess.run(["git", "-C", str(before), "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    if "p1" in only:
        results.update(p1_p4(args.turns, args.repeats, before))
        results["p1_breakdown"] = p1_breakdown(args.turns)
        if before is not None:
            results["p1_breakdown_before"] = p1_breakdown(args.turns, before)
    if "p2" in only:
        results["p2"] = p2(before=before, rounds=args.p2_rounds or args.repeats)
    if "p3" in only:
        results["p3"] = p3()
    if "p5" in only:
        results["p5"] = p5_run()
        if before is not None:
            results["p5_before"] = p5_run(before)
    if "p6" in only:
        from stream_bench import p6

        results["p6"] = p6(TOKENIZER, args.repeats)
    if "p1s" in only:
        from fleet_bench import p1_store

        results["p1_store"] = p1_store(args.turns, args.repeats, TOKENIZER, Backend().url)
    if "p2f" in only:
        from fleet_bench import p2_fleet

        results["p2_fleet"] = p2_fleet(TOKENIZER)
    if "p2i" in only:  # after every timed measure: three callgrind runs load both cores for ~15 minutes
        results["p2_instructions"] = p2_instructions(before)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
