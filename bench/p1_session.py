"""The P1 session, which P1, P1s, P6, the turn breakdown and the JSON read benchmark all send: its requests, the
checkpoints it is read at, how an agent sends it and times each turn, and the turns around a checkpoint.

Standard library only: `turn_breakdown.py` imports it before it puts the checkout it measures on sys.path (another
one with `run_all.py --before REV`), so an import of the package here would load the wrong one.
"""

from __future__ import annotations

import json
import time
import urllib.request

CHECKPOINTS = (2, 50, 100, 200)
TOOL_RESULT = " ".join(f"row {i}: value={i * 37 % 1000} status=ok" for i in range(60))  # about 500 tokens


def conversation(turns: int) -> list[list[dict]]:
    """The request of every turn: each appends the canned reply and a ~500-token tool result."""
    messages: list[dict] = [{"role": "system", "content": "You are a data agent."}, {"role": "user", "content": "Go."}]
    requests = []
    for turn in range(turns):
        requests.append(list(messages))
        messages += [{"role": "assistant", "content": "The answer is 21."},
                     {"role": "tool", "tool_call_id": f"c{turn}", "content": f"{turn}: {TOOL_RESULT}"}]  # fmt: skip
    return requests


def agent_body(body: dict) -> bytes:
    """A request body as openai-python writes it (compact separators, UTF-8 as is)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def post(url: str, body: dict, session: str) -> float:
    """Seconds one chat request to `url` takes, its answer read to the end."""
    return send(url, agent_body(body), session)


def send(url: str, data: bytes, session: str) -> float:
    """`post` of a body already written (in whichever JSON style a client writes it)."""
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=data, headers={"content-type": "application/json", "x-session-id": session}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.perf_counter() - started


def run_session(url: str, requests: list[list[dict]], session: str) -> list[float]:
    """Every turn's seconds, the session's requests sent one after another."""
    return [post(url, {"model": "m", "messages": m}, session) for m in requests]


def window(values: list[float], turn: int) -> list[float]:
    """The values of the five turns around `turn` (1-based): a checkpoint's median is taken over them."""
    index = turn - 1
    return values[max(0, index - 2) : index + 3]
