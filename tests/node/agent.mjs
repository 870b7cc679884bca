// The openai npm package as an unmodified agent: configured only by OPENAI_BASE_URL / OPENAI_API_KEY.
// usage: node agent.mjs TURNS [stream]   — prints one JSON line per turn.
import OpenAI from "openai";

const tools = [{
  type: "function",
  function: {
    name: "get_weather",
    description: "Get the current weather for a city",
    parameters: { type: "object", properties: { city: { type: "string" } }, required: ["city"] },
  },
}];

const client = new OpenAI({ maxRetries: 0 });
const turns = Number(process.argv[2] ?? 3);
const stream = process.argv[3] === "stream";
const messages = [{ role: "user", content: "What's the weather in Paris?" }];

for (let turn = 0; turn < turns; turn++) {
  let completion;
  if (stream) {
    const runner = client.chat.completions.stream({ model: "m", messages, tools });
    completion = await runner.finalChatCompletion();
  } else {
    completion = await client.chat.completions.create({ model: "m", messages, tools });
  }
  const choice = completion.choices[0];
  const message = choice.message;
  console.log(JSON.stringify({ finish_reason: choice.finish_reason, message }));
  const echoed = { role: "assistant", content: message.content ?? null };
  if (message.tool_calls?.length) {
    echoed.tool_calls = message.tool_calls.map(({ id, type, function: fn }) => ({ id, type, function: fn }));
  }
  messages.push(echoed);
  for (const call of message.tool_calls ?? []) {
    messages.push({ role: "tool", tool_call_id: call.id, content: '{"temp_c": 21}' });
  }
  if (!message.tool_calls?.length) messages.push({ role: "user", content: "And tomorrow in Oslo?" });
}
