"""P5: what reading an agent's request costs per API, as the history grows (in-process, no network).

Every API re-sends its whole history each turn, so reading it grows with the history in all of them; the question is
what the translation to the canonical form adds on top of chat, which is the canonical form already. The same
conversation (a ~20 KiB system prompt, then N turns of reasoning + one tool call + a 2 KiB tool result, as a coding
agent's history looks) is written in each API's shape; the cost is parsing it and keying its messages, which is
what a turn does before it looks anything up. Best of 7, ms.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from tito_addon.protocols.anthropic_messages import AnthropicMessagesApi
from tito_addon.protocols.openai_chat import ChatCompletionsApi
from tito_addon.protocols.openai_responses import OpenAIResponsesApi
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.sessions.message_keys import message_key

SYSTEM = "You are a coding agent. " * 800
THINKING = "I should list the files first. " * 10
RESULT = "drwxr-xr-x  2 root root 4096 Nov 30 12:00 src\n" * 40


def chat(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix it."}]
    for i in range(turns):
        call = {"id": f"call_{i}", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}
        messages.append({"role": "assistant", "content": None, "reasoning_content": THINKING, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": RESULT})
    return {"model": "m", "messages": messages}


def anthropic(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix it."}]}]
    for i in range(turns):
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": "ls"}}
        thinking = {"type": "thinking", "thinking": THINKING, "signature": "tito1.bXNn.AAAA"}
        messages.append({"role": "assistant", "content": [thinking, use]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                      "content": RESULT}]})  # fmt: skip
    return {"model": "m", "max_tokens": 4096, "system": [{"type": "text", "text": SYSTEM}], "messages": messages}


def responses(turns: int) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "developer", "content": SYSTEM}, {"role": "user", "content": "Fix it."}]
    for i in range(turns):
        items.append({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THINKING}]})
        items.append({"type": "function_call", "call_id": f"call_{i}", "name": "Bash", "arguments": '{"command":"ls"}'})
        items.append({"type": "function_call_output", "call_id": f"call_{i}", "output": RESULT})
    return {"model": "m", "input": items}


def read_cost(api: Any, body: bytes, repeats: int = 7) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        request = api.parse(body)
        [message_key(m) for m in request.chat.messages]
        best = min(best, time.perf_counter() - start)
    return best * 1000


def p5(points: tuple[int, ...] = (2, 50, 100, 200)) -> dict[str, Any]:
    signer = TurnSigner(b"bench-key-" * 4)
    apis: dict[str, tuple[Any, Callable[[int], dict[str, Any]]]] = {
        "chat": (ChatCompletionsApi(), chat),
        "anthropic_messages": (AnthropicMessagesApi(signer), anthropic),
        "openai_responses": (OpenAIResponsesApi(signer), responses),
    }
    rows = {}
    for turns in points:
        row: dict[str, Any] = {}
        for name, (api, make) in apis.items():
            body = json.dumps(make(turns)).encode()
            row[name] = {"ms": read_cost(api, body), "kib": len(body) / 1024}
        for name in ("anthropic_messages", "openai_responses"):
            row[name]["vs_chat"] = row[name]["ms"] / row["chat"]["ms"]
        rows[str(turns)] = row
    return rows
