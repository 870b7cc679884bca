"""Reading a backend's HTTP/1.1 response: the proxy's own parser (`backends/backend_connections.py`) against h11 (a
dependency already, through mitmproxy), on the answers a turn reads (issue 42: keep the hand-written parser only if
h11 costs more per turn).

    .venv/bin/python bench/response_parser.py [--repeat 200]   # prints JSON

Answers: a whole chat completion with 500 tokens' logprobs (Content-Length, ~32 KiB) delivered in 64 KiB reads, and a
streamed turn of 500 SSE events, one chunk each, delivered as a server writes them (a read per event) and in 64 KiB
reads. Each parser is timed on the same bytes, interleaved, the median of `--repeat` runs; only the parse is timed (no
socket).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import h11

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tito_addon.backends.backend_connections import _Connection  # noqa: E402

READ = 64 * 1024


def whole_answer() -> bytes:
    tokens = [{"token": f"tok{i}", "logprob": -0.25, "top_logprobs": []} for i in range(500)]
    body = json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 500},
                     "logprobs": {"content": tokens}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100000, "completion_tokens": 500},
    }).encode()  # fmt: skip
    head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode()
    return head + body


def stream_events() -> list[bytes]:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": "w"}}],
    }
    pieces = [head]
    for i in range(500):
        event = b"data: " + json.dumps({**chunk, "n": i}).encode() + b"\n\n"
        pieces.append(b"%x\r\n%s\r\n" % (len(event), event))
    pieces.append(b"0\r\n\r\n")
    return pieces


def in_reads(data: bytes) -> list[bytes]:
    return [data[i : i + READ] for i in range(0, len(data), READ)]


class _Transport(asyncio.Transport):
    def writelines(self, data: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Pool:
    def forget(self, connection: Any) -> None:
        pass


def ours(reads: list[bytes]) -> int:
    connection = _Connection(_Pool(), (False, "backend", 80))  # type: ignore[arg-type]
    connection.connection_made(_Transport())  # type: ignore[arg-type]
    connection.start("POST", [])
    size = 0
    for data in reads:
        connection.data_received(data)
        size += sum(map(len, connection._pieces))
        connection._pieces = []
    assert connection._done and connection._error is None
    return size


def theirs(reads: list[bytes]) -> int:
    connection = h11.Connection(h11.CLIENT)
    headers = [("host", "backend"), ("content-length", "0")]
    connection.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers))
    connection.send(h11.EndOfMessage())
    size = 0
    for data in reads:
        connection.receive_data(data)
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA or type(event) is h11.EndOfMessage:
                break
            if type(event) is h11.Data:
                size += len(event.data)
    return size


def timed(parse: Any, reads: list[bytes], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        parse(reads)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def measure(repeat: int) -> dict:
    events = stream_events()
    answers = {
        "whole, 64 KiB reads": in_reads(whole_answer()),
        "stream, a read per event": events,
        "stream, 64 KiB reads": in_reads(b"".join(events)),
    }
    out = {}
    for name, reads in answers.items():
        assert ours(reads) == theirs(reads), name
        ours_us, theirs_us = [], []
        for _ in range(5):  # interleaved rounds: a slow moment lands on both
            ours_us.append(timed(ours, reads, repeat // 5))
            theirs_us.append(timed(theirs, reads, repeat // 5))
        out[name] = {
            "bytes": sum(map(len, reads)),
            "ours_us": statistics.median(ours_us),
            "h11_us": statistics.median(theirs_us),
        }
        out[name]["h11_over_ours"] = out[name]["h11_us"] / out[name]["ours_us"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.repeat)), indent=1))


if __name__ == "__main__":
    main()
