"""The OpenAI Agents SDK running its own multi-turn tool loop, configured only by OPENAI_BASE_URL/OPENAI_API_KEY.
usage: python agents_sdk_agent.py   — prints one JSON line per agent run (final output, items)."""

import asyncio
import json

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return json.dumps({"city": city, "temp_c": 21, "sky": "clear"})


async def main() -> None:
    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(model="reference-model", openai_client=AsyncOpenAI(max_retries=0))
    agent = Agent(name="weather", instructions="You answer weather questions.", tools=[get_weather], model=model)
    first = await Runner.run(agent, "What's the weather in Paris?")
    print(json.dumps({"output": first.final_output, "items": len(first.new_items)}), flush=True)
    follow = first.to_input_list() + [{"role": "user", "content": "And in Oslo?"}]
    second = await Runner.run(agent, follow)
    print(json.dumps({"output": second.final_output, "items": len(second.new_items)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
