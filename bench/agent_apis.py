"""P5: what reading an agent's request costs per API, as the history grows (in-process, no network).

Every API re-sends its whole history each turn; the question is what reading it costs on top of the JSON parse,
per API. The same conversation (a ~20 KiB system prompt, then N turns of reasoning + one tool call + a 2 KiB tool
result, as a coding agent's history looks) is written in each API's shape, compact as the agents write it (Claude
Code with its `cache_control` marker on the newest block, which moves every turn). A turn is read as a proxy reads
it: right after the agent's previous request (turn N-1) was read, so whatever a process remembers of that one is
there; the cost is parsing the request and keying its messages, which is what a turn does before it looks anything
up. Median of 7, ms; "orjson" is parsing the same body with orjson alone.

Run on any checkout (`run_all.py --before REV` reads the old code the same way):

    .venv/bin/python bench/agent_apis.py [--repo PATH]   # prints JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEM = "You are a coding agent. " * 800
THINKING = "I should list the files first. " * 10
RESULT = "drwxr-xr-x  2 root root 4096 Nov 30 12:00 src\n" * 40
# An older checkout's memos: module globals (each API now holds its own, `api.memos`).
MEMOS = (
    ("tito_addon.protocols.openai_chat", "KNOWN_MESSAGES"),
    ("tito_addon.protocols.openai_chat", "KNOWN_REQUESTS"),
    ("tito_addon.protocols.anthropic_messages", "KNOWN_ANTHROPIC_REQUESTS"),
    ("tito_addon.protocols.openai_responses", "KNOWN_RESPONSES_REQUESTS"),
)


def compact(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def chat(turns: int) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix it."}]
    for i in range(turns):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
        messages.append({"role": "assistant", "content": None, "reasoning_content": THINKING, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": RESULT})
    return compact({"model": "m", "messages": messages})


def anthropic(turns: int) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix it."}]}]
    for i in range(turns):
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": "ls"}}
        thinking = {"type": "thinking", "thinking": THINKING, "signature": "tito1.bXNn.AAAA"}
        messages.append({"role": "assistant", "content": [thinking, use]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                      "content": RESULT}]})  # fmt: skip
    last = messages[-1]["content"][-1]
    messages[-1] = {**messages[-1], "content": [*messages[-1]["content"][:-1],
                                                {**last, "cache_control": {"type": "ephemeral"}}]}  # fmt: skip
    return compact({"model": "m", "max_tokens": 4096, "system": [{"type": "text", "text": SYSTEM}],
                    "messages": messages, "stream": True})  # fmt: skip


def responses(turns: int) -> bytes:
    items: list[dict[str, Any]] = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": "Fix it."}]
    for i in range(turns):
        items.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THINKING}]})
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "Bash", "arguments": '{"command":"ls"}'})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": RESULT})
    return compact({"model": "m", "input": items, "store": False, "stream": True})


def fresh_memos(*apis: Any) -> None:
    """Forget what the process read before (as a new proxy would have), on whichever checkout this runs: what each
    of `apis` remembers, or an older checkout's module memos."""
    for api in apis:
        for memo in getattr(api, "memos", ()):
            budget = memo.budget_bytes
            memo.resize(0)
            memo.resize(budget)
    for module_name, name in MEMOS:
        module = sys.modules.get(module_name)
        memo = getattr(module, name, None)
        if memo is None:
            continue
        if hasattr(memo, "member"):
            setattr(module, name, type(memo)(memo.budget_bytes, memo.min_prefix, memo.member))
        else:
            setattr(module, name, type(memo)())


def read_cost(api: Any, previous: bytes, body: bytes, repeats: int = 7) -> float:
    from tito_addon.sessions.message_keys import message_key

    times = []
    for _ in range(repeats):
        fresh_memos(api)
        [message_key(m) for m in api.parse(previous).chat.messages]  # as the proxy did on the previous turn
        start = time.perf_counter()
        request = api.parse(body)
        [message_key(m) for m in request.chat.messages]
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def orjson_cost(body: bytes, repeats: int = 7) -> float:
    import orjson

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        orjson.loads(body)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def p5(points: tuple[int, ...] = (2, 50, 100, 200)) -> dict[str, Any]:
    from tito_addon.protocols.anthropic_messages import AnthropicMessagesApi
    from tito_addon.protocols.openai_chat import ChatCompletionsApi
    from tito_addon.protocols.openai_responses import OpenAIResponsesApi
    from tito_addon.protocols.turn_refs import TurnSigner

    signer = TurnSigner(b"bench-key-" * 4)
    apis: dict[str, tuple[Any, Callable[[int], bytes]]] = {
        "chat": (ChatCompletionsApi(), chat),
        "anthropic_messages": (AnthropicMessagesApi(signer), anthropic),
        "openai_responses": (OpenAIResponsesApi(signer), responses),
    }
    rows = {}
    for turns in points:
        row: dict[str, Any] = {}
        for name, (api, make) in apis.items():
            body = make(turns)
            row[name] = {"ms": read_cost(api, make(turns - 1), body), "kib": len(body) / 1024,
                         "orjson_ms": orjson_cost(body)}  # fmt: skip
        for name in ("anthropic_messages", "openai_responses"):
            row[name]["vs_chat"] = row[name]["ms"] / row["chat"]["ms"]
        rows[str(turns)] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    print(json.dumps(p5()))


if __name__ == "__main__":
    main()
