"""Benchmarks P1, P3 and P4 (issue 6), as ratios against baselines measured in the same run.

    .venv/bin/python bench/run_all.py [--turns 200] [--repeats 3] [--out bench/results.json]

P1  per-turn added latency vs history length: one session of N turns, each appending a ~500-token tool result,
    through mitmdump + addon against a zero-latency backend, minus plain mitmdump reverse passthrough of the
    same requests (and minus direct); plus the naive baseline's cost: re-rendering and re-tokenizing the whole
    history every turn.
P3  memory per stored token: 1,000 sessions x 20k tokens in the session tree (ids only; logprobs live on disk).
P4  recording bytes per token for the N-turn session, vs the trajectory's own size (its final ids + logprobs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from zero_latency_backend import start as start_backend  # noqa: E402

from tito_addon.proxy_process import LISTEN, Mitmdump  # noqa: E402
from tito_addon.record_reader import read_session_file  # noqa: E402

TOKENIZER = os.environ.get("TITO_BENCH_TOKENIZER", str(REPO.parent / "shared" / "tokenizers" / "qwen3"))
CHECKPOINTS = (2, 50, 100, 200)
TOOL_RESULT = " ".join(f"row {i}: value={i * 37 % 1000} status=ok" for i in range(60))  # about 500 tokens


class Backend:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.runner, self.port = self.loop.run_until_complete(start_backend())
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"


def plain_mitmdump(target: str) -> tuple[subprocess.Popen, int]:
    mitmdump = Path(sys.executable).with_name("mitmdump")
    argv = [str(mitmdump), "--mode", f"reverse:{target}", "--listen-host", "127.0.0.1", "-p", "0"]
    proc = subprocess.Popen(argv + ["--set", "flow_detail=0"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = LISTEN.search(line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, int(match.group(1))
    raise RuntimeError("plain mitmdump did not start")


def post(url: str, body: dict, session: str) -> float:
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=data, headers={"content-type": "application/json", "x-session-id": session}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def conversation(turns: int) -> list[list[dict]]:
    """The request of every turn: each appends the canned reply and a ~500-token tool result."""
    messages: list[dict] = [{"role": "system", "content": "You are a data agent."}, {"role": "user", "content": "Go."}]
    requests = []
    for turn in range(turns):
        requests.append(list(messages))
        messages += [{"role": "assistant", "content": "The answer is 21."},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn}: {TOOL_RESULT}"}]  # fmt: skip
    return requests


def run_session(url: str, requests: list[list[dict]], session: str) -> list[float]:
    return [post(url, {"model": "m", "messages": m}, session) for m in requests]


def window(values: list[float], turn: int) -> list[float]:
    index = turn - 1
    return values[max(0, index - 2) : index + 3]


def p1_p4(turns: int, repeats: int) -> dict:
    backend = Backend()
    requests = conversation(turns)
    record_dir = Path(tempfile.mkdtemp(prefix="tito-bench-"))
    addon, plain, direct = [], [], []
    with Mitmdump(backend.url, tokenizer=TOKENIZER, record_dir=record_dir, cwd=record_dir,
                  extra_args=["--set", "flow_detail=0"]) as proxy:  # fmt: skip
        for r in range(repeats):
            addon.append(run_session(proxy.url, requests, f"bench-{r}"))
    proc, port = plain_mitmdump(backend.url)
    try:
        for r in range(repeats):
            plain.append(run_session(f"http://127.0.0.1:{port}", requests, f"plain-{r}"))
    finally:
        proc.terminate()
        proc.wait(20)
    for r in range(repeats):
        direct.append(run_session(backend.url, requests, f"direct-{r}"))

    from tito_addon.token_engine import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER, trust_remote_code=False)

    def naive(turn: int) -> float:
        started = time.perf_counter()
        text = tokenizer.apply_chat_template(requests[turn - 1], tokenize=False, add_generation_prompt=True)
        tokenizer.encode(text, add_special_tokens=False)
        return time.perf_counter() - started

    result: dict = {"p1": {}}
    for turn in (t for t in CHECKPOINTS if t <= turns):
        a = statistics.median(x for run in addon for x in window(run, turn))
        p = statistics.median(x for run in plain for x in window(run, turn))
        d = statistics.median(x for run in direct for x in window(run, turn))
        n = statistics.median(naive(turn) for _ in range(5))
        result["p1"][turn] = {
            "addon_ms": a * 1e3, "passthrough_ms": p * 1e3, "direct_ms": d * 1e3,
            "added_vs_passthrough_ms": (a - p) * 1e3, "added_vs_direct_ms": (a - d) * 1e3,
            "naive_rerender_ms": n * 1e3,
        }  # fmt: skip
    first, last = result["p1"][min(result["p1"])], result["p1"][max(result["p1"])]
    result["p1"]["last_over_first_added"] = last["added_vs_passthrough_ms"] / max(
        first["added_vs_passthrough_ms"], 1e-9
    )

    session_file = read_session_file(record_dir / "bench-0.jsonl")
    ids = session_file.full_ids()
    leaf = session_file.turns[-1]
    prompt, completion = ids[leaf.turn_id]
    logprobs = [lp for t in session_file.turns for lp in t.completion_logprobs]
    own = len(json.dumps({"ids": prompt + completion, "logprobs": logprobs}, separators=(",", ":")))
    file_bytes = (record_dir / "bench-0.jsonl").stat().st_size
    result["p4"] = {
        "tokens": len(prompt) + len(completion),
        "file_bytes": file_bytes,
        "trajectory_bytes": own,
        "bytes_per_token": file_bytes / (len(prompt) + len(completion)),
        "ratio": file_bytes / own,
    }
    return result


def p3(sessions: int = 1000, tokens_per_session: int = 20_000, turns: int = 20) -> dict:
    from tito_addon.message_keys import message_key
    from tito_addon.session_tree import SessionStore
    from tito_addon.wire_models import ChatMessage

    per_turn = tokens_per_session // turns
    user = ChatMessage(role="user", content="q")
    reply = ChatMessage(role="assistant", content="a")
    keys = (message_key(user), message_key(reply))
    ids = list(range(100, 100 + per_turn // 2))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = SessionStore()
    for s in range(sessions):
        session = store.new_session(f"s{s}")
        parent = None
        for t in range(turns):
            parent = store.commit(session, parent, 2 * (t + 1), keys, (None, None), ids, ids, "stop")
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    total = sessions * turns * 2 * len(ids)
    return {"sessions": sessions, "tokens": total, "bytes": used, "bytes_per_token": used / total}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results.json")
    args = parser.parse_args()
    results = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "command": " ".join(sys.argv),
    }
    results.update(p1_p4(args.turns, args.repeats))
    results["p3"] = p3()
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
