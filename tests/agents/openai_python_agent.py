"""An unmodified openai-python tool loop, configured only by the environment (OPENAI_BASE_URL, OPENAI_API_KEY,
HTTP(S)_PROXY, SSL_CERT_FILE). usage: python openai_python_agent.py TURNS MODE   (MODE: sync | async | stream)
Prints one JSON line per turn: the finish reason, the message, and the tito headers it carried."""

import asyncio
import json
import sys

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


def next_messages(messages: list, message) -> None:
    echoed = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        echoed["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls]
    messages.append(echoed)
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'})
    if not message.tool_calls:
        messages.append({"role": "user", "content": "And tomorrow in Oslo?"})


def report(reply) -> None:
    choice = reply.choices[0]
    print(json.dumps({"finish_reason": choice.finish_reason, "message": choice.message.model_dump()}), flush=True)


def run_sync(turns: int, stream: bool) -> None:
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    for _ in range(turns):
        if stream:
            with client.chat.completions.stream(model="m", messages=messages, tools=TOOLS) as events:
                for _event in events:
                    pass
                reply = events.get_final_completion()
        else:
            reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        report(reply)
        next_messages(messages, reply.choices[0].message)


async def run_async(turns: int) -> None:
    client = openai.AsyncOpenAI(max_retries=0)
    messages = [{"role": "user", "content": "What's the weather in Lima?"}]
    for _ in range(turns):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        report(reply)
        next_messages(messages, reply.choices[0].message)
    await client.close()


if __name__ == "__main__":
    count, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "async":
        asyncio.run(run_async(count))
    else:
        run_sync(count, stream=mode == "stream")
