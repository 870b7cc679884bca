"""The proxy's added latency per turn by the JSON style the agent's client writes (issue 42): the P1 session sent
compact with UTF-8 as is (openai-python, httpx, Node) and spaced with ASCII escapes (Python's `json.dumps`, as
requests and aiohttp write it), each through an addon of its own, turn by turn interleaved with plain mitmdump, so a
slow moment of the machine lands on every configuration. Plain mitmdump carries the very body the addon sent the
backend for that turn (the prompt as ids), so both sides include the same backend work and the difference is the
proxy's own cost (issue 42's measure): `added_ms`, the median over the five turns around a checkpoint of the addon's
time less plain mitmdump's. `added_vs_messages_ms` is against plain mitmdump carrying the agent's own body instead
(the backend then reads messages, not ~600 KiB of ids).

    .venv/bin/python bench/client_styles.py [--turns 200] [--repo PATH]   # prints JSON

`--repo`: the checkout whose addon is measured (a `git worktree` of another revision), for a before and after in one
session.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from local_servers import Backend, PlainMitmdump
from measurements import REPO, TOKENIZER, added_at
from p1_session import CHECKPOINTS, conversation, send

from tito_addon.replicas.proxy_process import Mitmdump

STYLES: dict[str, Callable[[dict], bytes]] = {
    "compact": lambda body: json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
    "spaced_ascii": lambda body: json.dumps(body).encode(),
}


def client_styles(turns: int, repo: Path = REPO) -> dict:
    backend = Backend()
    record_dir = Path(tempfile.mkdtemp(prefix="tito-bench-styles-"))
    # One addon process per style: a turn's messages read in one style would otherwise be known to the other's
    # turn, which would then measure a warm memo rather than its own path.
    for style in STYLES:
        (record_dir / style).mkdir()
    addons = {
        style: Mitmdump(
            backend.url,
            tokenizer=TOKENIZER,
            record_dir=record_dir / style,
            cwd=record_dir,
            repo=repo,
            extra_args=["--set", "flow_detail=0"],
        ).start()  # fmt: skip
        for style in STYLES
    }
    plain = PlainMitmdump(backend.url)
    times: dict[str, dict[str, list[float]]] = {style: {"addon": [], "plain": [], "messages": []} for style in STYLES}
    try:
        for messages in conversation(turns):
            for style, encode in STYLES.items():
                data = encode({"model": "m", "messages": messages})
                times[style]["addon"].append(send(addons[style].url, data, f"{style}-addon"))
                times[style]["plain"].append(send(plain.url, backend.last_ids_body(), f"{style}-plain"))
                times[style]["messages"].append(send(plain.url, data, f"{style}-messages"))
    finally:
        plain.stop()
        for addon in addons.values():
            addon.stop()
    out: dict = {}
    for style, measured in times.items():
        for turn in (t for t in CHECKPOINTS if t <= turns):
            out.setdefault(style, {})[turn] = added_at(measured, turn)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repo", type=Path, default=REPO)
    args = parser.parse_args()
    print(json.dumps(client_styles(args.turns, args.repo), indent=1))


if __name__ == "__main__":
    main()
