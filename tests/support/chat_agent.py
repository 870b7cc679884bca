"""The chat agent the integration tests drive: the openai SDK against a mitmdump, a tool-using conversation that
appends what a typical agent appends (`basics.echo`) and answers each tool call; and the unmodified openai-python
agent script the proxy-mode tests run with only its environment set."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import openai

from .basics import REPO, TOOLS, echo

# The API key the agent sends (one the session-wide audit looks for in every proxy log and recording).
SECRET = "sk-tito-test-SECRET-4f9a1c"
AGENT = REPO / "tests" / "agents" / "openai_python_agent.py"


def agent(proxy, session: str | None = None, **kw) -> openai.OpenAI:
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=SECRET, default_headers=headers, max_retries=0, **kw)


def take_turn(
    client: openai.OpenAI,
    messages: list[dict],
    *,
    model: str = "reference-model",
    stream: bool = False,
    result: str | Callable[[Any, int], str] = "21C",
    follow_up: str = "Thanks. And tomorrow?",
    **asked: Any,
) -> Any:
    """One turn of a tool-using agent: asked whole or streamed (with `asked`'s request fields besides), its answer
    appended as a typical agent appends it, then a result for each tool call (`result`, or `result(call, index)`) or,
    after a plain answer, the user's `follow_up`. The completion."""
    if stream:
        with client.chat.completions.stream(model=model, messages=messages, tools=TOOLS, **asked) as events:
            for _ in events:
                pass
            completion = events.get_final_completion()
    else:
        completion = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, **asked)
    message = completion.choices[0].message
    messages.append(echo(message))
    for index, call in enumerate(message.tool_calls or []):
        content = result(call, index) if callable(result) else result
        messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    if not message.tool_calls:
        messages.append({"role": "user", "content": follow_up})
    return completion


def run_agent(client: openai.OpenAI, turns: int, *, stream: bool = False, first: str = "Weather in Paris?"):
    messages: list[dict] = [
        {"role": "system", "content": "You are a travel agent."},
        {"role": "user", "content": first},
    ]
    replies = []
    for turn in range(turns):

        def result(call: Any, index: int, turn: int = turn) -> str:
            return f"result {turn}.{index}: {json.loads(call.function.arguments)}"

        follow_up = f"Thanks. Now Oslo, round {turn}?"
        replies.append(take_turn(client, messages, stream=stream, result=result, follow_up=follow_up))
    return messages, replies
