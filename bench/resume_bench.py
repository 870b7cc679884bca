"""What a resumption costs (issue 43): a turn cut by a weight update (an abort-mode pause, then the resume at once)
against the same turn uncut, through mitmdump + the addon and the vLLM or sglang replica, on prompts of several lengths.

    .venv/bin/python bench/resume_bench.py [--kind vllm|sglang] [--prompts 1000,8000,30000] [--repeats 5]

Per prompt length: the bytes the proxy sent to generate (uncut: one request; cut: two, the second on prompt +
partial), and the turn's wall time uncut and cut, the cut one less nothing (the pause is released at once, so what
is added is the second request's round trip: our stitching, the JSON of prompt + partial ids, the server's parse;
on sglang also the three parse-route calls over the whole completion).
The replica samples a token every 2 ms, so both turns spend the same time generating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support.basics import tokenizer_path  # noqa: E402
from support.proxy_harness import Mitmdump, post  # noqa: E402

from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread  # noqa: E402
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread  # noqa: E402

#: Per kind: the replica, its abort-mode pause (path, body) and its resume.
KINDS = {
    "vllm": (("/pause?mode=abort", None), "/resume"),
    "sglang": (("/pause_generation", {"mode": "abort"}), "/continue_generation"),
}

WORDS = "the quick brown fox jumps over a lazy dog while agents call tools and read long results ".split()


def prompt_of(tokens: int) -> str:
    # ~1.3 tokens per word of this text under Qwen3's tokenizer; close enough for a length class.
    return " ".join(WORDS[i % len(WORDS)] for i in range(int(tokens / 1.3)))


def sent(replica) -> list:
    """What the replica received: vLLM's (path, body) pairs, sglang's chat bodies."""
    if isinstance(replica, VllmReplicaThread):
        return replica.received()
    return replica.backend.received_copy()


def generate_bytes(replica, since: int) -> list[int]:
    """The bytes of each generating request since `since` (vLLM's generate, sglang's chat completion)."""
    got = sent(replica)[since:]
    bodies = [b for p, b in got if p.endswith("/generate")] if isinstance(replica, VllmReplicaThread) else got
    return [len(json.dumps(body, separators=(",", ":"))) for body in bodies]


def one_turn(proxy: Mitmdump, session: str, text: str) -> float:
    began = time.perf_counter()
    reply = post(
        proxy.url + "/v1/chat/completions",
        timeout=120,
        headers={"x-session-id": session},
        json={"model": "tiny-qwen3", "messages": [{"role": "user", "content": text}], "max_tokens": 400},
    )
    assert reply.status_code == 200, reply.text[:300]
    return time.perf_counter() - began


def cut_turn(replica, proxy: Mitmdump, session: str, text: str, kind: str) -> float:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(s=one_turn(proxy, session, text)))
    thread.start()
    while not any(len(g.labels) >= 20 for g in list(replica.backend.pause.in_flight.values())):
        time.sleep(0.0005)
    (pause, body), resume = KINDS[kind]
    post(replica.url + pause, json=body)
    post(replica.url + resume)
    thread.join()
    return out["s"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=sorted(KINDS), default="vllm")
    parser.add_argument("--prompts", default="1000,8000,30000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.kind == "vllm":
        config = VllmReplicaConfig(
            tokenizer=tokenizer_path("qwen3"), token_delay_s=0.002, max_model_len=40960, answer_sentences=4
        )
        engine = VllmReplicaThread(config)
    else:
        engine = ReplicaThread(
            ReplicaConfig(tokenizer=tokenizer_path("qwen3"), token_delay_s=0.002, context_length=40960,
                          answer_sentences=4)
        )  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp, engine as replica:
        options = {"tito_backend_kind": args.kind}
        with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=Path(tmp) / "rec", cwd=Path(tmp),
                      options=options) as proxy:  # fmt: skip
            for size in map(int, args.prompts.split(",")):
                text = prompt_of(size)
                uncut_s, cut_s, uncut_b, cut_b = [], [], [], []
                for repeat in range(args.repeats + 1):  # the first pair warms both paths
                    since = len(sent(replica))
                    a = one_turn(proxy, f"u{size}-{repeat}", text)
                    ua = generate_bytes(replica, since)
                    since = len(sent(replica))
                    b = cut_turn(replica, proxy, f"c{size}-{repeat}", text, args.kind)
                    cb = generate_bytes(replica, since)
                    assert len(ua) == 1 and len(cb) == 2, (ua, cb)
                    if repeat:
                        uncut_s.append(a)
                        cut_s.append(b)
                        uncut_b.append(sum(ua))
                        cut_b.append(sum(cb))
                row = {
                    "kind": args.kind,
                    "prompt_tokens": size,
                    "uncut_ms": round(statistics.median(uncut_s) * 1000, 1),
                    "cut_ms": round(statistics.median(cut_s) * 1000, 1),
                    "added_ms": round((statistics.median(cut_s) - statistics.median(uncut_s)) * 1000, 1),
                    "uncut_bytes": statistics.median(uncut_b),
                    "cut_bytes": statistics.median(cut_b),
                    "bytes_ratio": round(statistics.median(cut_b) / statistics.median(uncut_b), 2),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
