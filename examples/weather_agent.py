"""An ordinary openai-python tool-calling agent, knowing nothing of tito: configured only by its environment
(OPENAI_BASE_URL, OPENAI_API_KEY, HTTP_PROXY / HTTPS_PROXY), it asks about the weather, runs the model's tool calls
and stops when the model answers without one (or after --max-steps). Prints one JSON line: what it ended with.

    python examples/weather_agent.py "What's the weather in Paris?" [--max-steps 6] [--stream]
"""

from __future__ import annotations

import argparse
import json

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def get_weather(arguments: str) -> str:
    try:
        city = json.loads(arguments).get("city")
    except (ValueError, AttributeError):
        return json.dumps({"error": "arguments are not a JSON object"})
    if not isinstance(city, str) or not city:
        return json.dumps({"error": "no city"})
    return json.dumps({"city": city, "temp_c": 10 + sum(map(ord, city)) % 20, "sky": "clear"})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("task")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    client = openai.OpenAI(max_retries=0)
    messages: list[dict] = [{"role": "user", "content": args.task}]
    tool_calls = errors = 0
    finish = None
    for _ in range(args.max_steps):
        if args.stream:
            with client.chat.completions.stream(model=args.model, messages=messages, tools=TOOLS) as events:
                for _event in events:
                    pass
                reply = events.get_final_completion()
        else:
            reply = client.chat.completions.create(model=args.model, messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        finish = choice.finish_reason
        message = {"role": "assistant", "content": choice.message.content}
        if choice.message.tool_calls:
            message["tool_calls"] = [
                c.model_dump(include={"id", "type", "function"}) for c in choice.message.tool_calls
            ]
        messages.append(message)
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            result = get_weather(call.function.arguments)
            tool_calls += 1
            errors += "error" in json.loads(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") if messages[-1]["role"] == "assistant" else None
    print(json.dumps({"finish_reason": finish, "answer": answer, "tool_calls": tool_calls, "tool_errors": errors}))


if __name__ == "__main__":
    main()
