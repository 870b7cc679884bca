"""The proxy's added latency per turn by the JSON style the agent's client writes (issue 42): the P1 session sent
compact with UTF-8 as is (openai-python, httpx, Node) and spaced with ASCII escapes (Python's `json.dumps`, as
requests and aiohttp write it), each through the addon and through plain mitmdump, turn by turn interleaved, so a
slow moment of the machine lands on every configuration. The added latency at a checkpoint is the median over the
five turns around it of the addon's time less plain mitmdump's, for the same bytes. It includes the backend's read of
what each proxy sends it (the addon sends ids, plain mitmdump the agent's messages).

    .venv/bin/python bench/client_styles.py [--turns 200] [--repo PATH]   # prints JSON

`--repo`: the checkout whose addon is measured (a `git worktree` of another revision), for a before and after in one
session.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from local_servers import Backend, PlainMitmdump
from measurements import REPO, TOKENIZER
from p1_session import CHECKPOINTS, conversation, send, window

from tito_addon.replicas.proxy_process import Mitmdump

STYLES: dict[str, Callable[[dict], bytes]] = {
    "compact": lambda body: json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
    "spaced_ascii": lambda body: json.dumps(body).encode(),
}


def client_styles(turns: int, repo: Path = REPO) -> dict:
    backend = Backend()
    record_dir = Path(tempfile.mkdtemp(prefix="tito-bench-styles-"))
    addon = Mitmdump(backend.url, tokenizer=TOKENIZER, record_dir=record_dir, cwd=record_dir, repo=repo,
                     extra_args=["--set", "flow_detail=0"]).start()  # fmt: skip
    plain = PlainMitmdump(backend.url)
    times: dict[str, dict[str, list[float]]] = {style: {"addon": [], "plain": []} for style in STYLES}
    try:
        for messages in conversation(turns):
            for style, encode in STYLES.items():
                data = encode({"model": "m", "messages": messages})
                times[style]["addon"].append(send(addon.url, data, f"{style}-addon"))
                times[style]["plain"].append(send(plain.url, data, f"{style}-plain"))
    finally:
        plain.stop()
        addon.stop()
    out: dict = {}
    for style, measured in times.items():
        for turn in (t for t in CHECKPOINTS if t <= turns):
            added = [
                a - p for a, p in zip(window(measured["addon"], turn), window(measured["plain"], turn), strict=True)
            ]
            out.setdefault(style, {})[turn] = {
                "addon_ms": statistics.median(window(measured["addon"], turn)) * 1e3,
                "plain_ms": statistics.median(window(measured["plain"], turn)) * 1e3,
                "added_ms": statistics.median(added) * 1e3,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args()
    print(json.dumps(client_styles(args.turns, args.repo), indent=1))


if __name__ == "__main__":
    main()
