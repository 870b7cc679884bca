"""The chat agent the integration tests drive: the openai SDK against a mitmdump, a tool-using conversation that
appends what a typical agent appends (`basics.echo`) and answers each tool call; and the unmodified openai-python
agent script the proxy-mode tests run with only its environment set."""

from __future__ import annotations

import json

import openai

from .basics import REPO, TOOLS, echo

# The API key the agent sends (one the session-wide audit looks for in every proxy log and recording).
SECRET = "sk-tito-test-SECRET-4f9a1c"
AGENT = REPO / "tests" / "agents" / "openai_python_agent.py"


def agent(proxy, session: str | None = None, **kw) -> openai.OpenAI:
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=SECRET, default_headers=headers, max_retries=0, **kw)


def run_agent(client: openai.OpenAI, turns: int, *, stream: bool = False, first: str = "Weather in Paris?"):
    messages: list[dict] = [
        {"role": "system", "content": "You are a travel agent."},
        {"role": "user", "content": first},
    ]
    replies = []
    for turn in range(turns):
        if stream:
            with client.chat.completions.stream(model="reference-model", messages=messages, tools=TOOLS) as events:
                for _ in events:
                    pass
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.create(model="reference-model", messages=messages, tools=TOOLS)
        message = completion.choices[0].message
        replies.append(completion)
        messages.append(echo(message))
        if message.tool_calls:
            for index, call in enumerate(message.tool_calls):
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}.{index}: {args}"})
        else:
            messages.append({"role": "user", "content": f"Thanks. Now Oslo, round {turn}?"})
    return messages, replies
