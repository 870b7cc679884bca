"""OpenAI Responses through a real mitmdump, with the real openai SDK (and the Agents SDK on its default Responses
model) as the agent: token-exact turns, the items and streams the SDK accumulates, previous_response_id served from
the session tree (after a restart too), item identity across what Codex changes, encrypted reasoning, errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post
from support.responses_agent import echo, outputs
from support.token_exact import assert_token_exact

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False,
    },
    {
        "type": "namespace",
        "name": "clock",
        "tools": [
            {
                "type": "function",
                "name": "get_time",
                "description": "Local time in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            }
        ],
    },
    {"type": "web_search"},
]
DEVELOPER = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
]


def start_proxy(replica, tmp_path: Path) -> Mitmdump:
    record_dir = tmp_path / "rec"
    proxy = Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path)
    proxy.record_dir = record_dir
    return proxy


def client(proxy) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0)


def test_a_codex_shaped_session_is_token_exact(proxy, replica) -> None:
    api = client(proxy)
    history: list[dict] = [*DEVELOPER, {"type": "message", "role": "user", "content": "Weather in Paris?"}]
    responses = []
    for follow_up in ("And Rome?", "Thanks."):
        reply = api.responses.create(
            model="qwen3", input=history, tools=TOOLS, store=False, include=["reasoning.encrypted_content"],
            reasoning={"summary": "auto"},
        )  # fmt: skip
        responses.append(reply)
        assert reply.id.startswith("resp_") and reply.status == "completed"
        kinds = [item.type for item in reply.output]
        assert kinds[0] == "reasoning" and kinds[-1] == "function_call"  # a third turn calls two tools with a note
        call = next(item for item in reply.output if item.type == "function_call")
        assert call.id.startswith("fc_") and call.name == "get_weather"
        assert reply.output[0].encrypted_content.startswith("tito1.")
        history += echo(reply) + outputs(reply)
        answer = api.responses.create(
            model="qwen3", input=history, tools=TOOLS, store=False, include=["reasoning.encrypted_content"],
            reasoning={"summary": "auto"},
        )  # fmt: skip
        responses.append(answer)
        assert [item.type for item in answer.output] == ["reasoning", "message"]
        assert "Turn " in answer.output_text
        history += echo(answer) + [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": follow_up}]}
        ]
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 1, 2]
    assert all(t.api == "openai_responses" for t in turns)
    assert [t.reply_id for t in turns] == [r.id for r in responses]
    for response, turn in zip(responses, turns, strict=True):
        assert response.usage.input_tokens == turn.prompt_len
        assert response.usage.output_tokens == len(turn.completion_ids)
    assert any("web_search" in note for note in turns[0].left_out)
    # The developer messages are system messages to the model; a namespaced tool is offered as namespace__name.
    assert [m["role"] for m in turns[0].appended_messages[:2]] == ["system", "system"]
    sent = replica.received()[0]
    assert [t["function"]["name"] for t in sent["tools"]] == ["get_weather", "clock__get_time"]
    assert sent["messages"] == [{"role": "user", "content": ""}], "sglang reads none of them given input_ids"


def test_stream_accumulates_to_the_same_response_as_create(proxy, replica) -> None:
    api = client(proxy)
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = api.responses.create(model="qwen3", input=history, tools=TOOLS[:1])
    with api.responses.stream(model="qwen3", input=history, tools=TOOLS[:1]) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_item.done" in kinds

    def shape(response) -> list[dict]:
        ignored = ("id", "call_id", "parsed_arguments")
        return [{k: v for k, v in i.model_dump().items() if k not in ignored} for i in response.output]

    assert shape(streamed) == shape(whole)
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    # A live stream's items end in the same ids as the response it completes with.
    answer = api.responses.create(model="qwen3", input=history + echo(streamed) + outputs(streamed), tools=TOOLS[:1])
    assert answer.output_text
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, None, 1]


def test_previous_response_id_continues_the_stored_turn_even_after_a_restart(replica, tmp_path: Path) -> None:
    replica.backend.reset()
    with start_proxy(replica, tmp_path) as proxy:
        api = client(proxy)
        first = api.responses.create(model="qwen3", input="Weather in Lima?", tools=TOOLS[:1], instructions="Be brief.")
        second = api.responses.create(
            model="qwen3",
            previous_response_id=first.id,
            input=outputs(first),
            tools=TOOLS[:1],
            instructions="Be brief.",
        )
        assert second.previous_response_id == first.id
    with start_proxy(replica, tmp_path) as proxy:  # a new process on the same record dir
        third = client(proxy).responses.create(
            model="qwen3", previous_response_id=second.id, input=[{"role": "user", "content": "And Quito?"}],
            tools=TOOLS[:1],
        )  # fmt: skip
        missing = post(
            proxy.url + "/v1/responses", json={"model": "qwen3", "previous_response_id": "resp_nope", "input": "x"}
        )
    turns = assert_token_exact(tmp_path / "rec", replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 1]
    assert [t.reply_id for t in turns] == [first.id, second.id, third.id]
    assert any("instructions" in note for note in turns[1].left_out)
    # OpenAI's own answer: a 400 that no client retries, its code saying which reference failed.
    error = missing.json()["error"]
    assert missing.status_code == 400 and missing.headers["x-should-retry"] == "false"
    assert error["type"] == "invalid_request_error" and error["code"] == "previous_response_not_found", error


def test_reasoning_round_trips_through_encrypted_content_only(proxy, replica) -> None:
    """Codex echoes a reasoning item with `content: null`: the sealed text is what makes it match; a forged
    seal is left out (the record says so), and the turn still continues by its visible items."""
    api = client(proxy)
    first = api.responses.create(
        model="qwen3", input="Weather in Kyiv?", tools=TOOLS[:1], include=["reasoning.encrypted_content"]
    )
    items = echo(first)
    items[0]["content"] = None
    items[0] = {k: v for k, v in items[0].items() if v is not None}
    user = {"role": "user", "content": "Weather in Kyiv?"}
    api.responses.create(model="qwen3", input=[user, *items, *outputs(first)], tools=TOOLS[:1])
    forged = [dict(item) for item in items]
    forged[0]["encrypted_content"] = forged[0]["encrypted_content"][:-4] + "AAAA"
    api.responses.create(model="qwen3", input=[user, *forged, *outputs(first)], tools=TOOLS[:1])
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 0]
    assert turns[1].left_out is None
    assert any("encrypted_content that is not ours" in note for note in turns[2].left_out)


def test_the_agents_sdk_on_its_default_responses_model(proxy, replica) -> None:
    agents = pytest.importorskip("agents")

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return f"{city}: 21 C, sunny"

    async def run() -> str:
        model = agents.OpenAIResponsesModel(
            model="qwen3", openai_client=openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="sk-client")
        )
        agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model)
        result = await agents.Runner.run(agent, "Weather in Cairo?", run_config=agents.RunConfig(tracing_disabled=True))
        return str(result.final_output)

    final = asyncio.run(run())
    assert "Turn 2" in final
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0]
    assert turns[0].api == "openai_responses"


def test_bad_requests_are_openai_errors_and_change_nothing(proxy, replica) -> None:
    cases = [
        {"model": "qwen3"},
        {"model": "qwen3", "input": []},
        {"model": "qwen3", "input": [{"type": "message", "role": "robot", "content": "x"}]},
        {"model": "qwen3", "input": [{"type": "mystery"}]},
        {"model": "qwen3", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
        {"model": "qwen3", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"model": "qwen3", "input": "x", "max_output_tokens": 0},
        {"model": "qwen3", "input": "x", "text": {"format": {"type": "grammar"}}},
    ]
    for body in cases:
        reply = post(proxy.url + "/v1/responses", json=body)
        assert reply.status_code == 400, (body, reply.text)
        assert reply.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client(proxy).responses.create(model="qwen3", input=[{"type": "mystery"}])
    # What Codex sends for its own models (Responses Lite): refused with the item and the setting that avoids it.
    lite = {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [{"type": "namespace",
            "name": "functions", "tools": [{"type": "custom", "name": "exec"}]}]}  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=r"input\.0: 'additional_tools' items are not supported"):
        client(proxy).responses.create(model="gpt-5.6", input=[lite, {"role": "user", "content": "hi"}])
    assert replica.received() == [] and not list(proxy.record_dir.glob("*.jsonl"))


def test_session_scoped_base_urls_name_the_session(proxy, replica) -> None:
    api = openai.OpenAI(base_url=proxy.url + "/sessions/codex-1/v1", api_key="sk-client", max_retries=0)
    first = api.responses.create(model="qwen3", input="hi")
    api.responses.create(model="qwen3", input="hello", previous_response_id=first.id)
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [(t.session_id, t.parent_turn_id) for t in turns] == [("codex-1", None), ("codex-1", 0)]
