"""Anthropic Messages and OpenAI Responses streamed live (vLLM replica: streaming generate + derender): the same
ids as a whole turn, the SDKs' accumulators, errors before the first event in the API's shape, a failure mid-stream
ending in the API's own error event with nothing recorded, and stop reasons (stop sequence, max tokens)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anthropic
import openai
import pytest
from support.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

MODEL = "tiny-qwen3"
RESPONSES_TOOLS = [{"type": "function", "name": t["name"], "parameters": t["input_schema"]} for t in ANTHROPIC_TOOLS]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), stream_delay_s=0.01)
    record_dir = tmp_path_factory.mktemp("rec")
    with (
        VllmReplicaThread(config) as replica,
        Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent,
                 options={"tito_backend_kind": "vllm"}) as proxy,
    ):  # fmt: skip
        yield replica, proxy, record_dir


def turns_of(record_dir: Path, session: str):
    path = record_dir / session_file_name(session)
    return read_session_file(path).turns if path.exists() else []


def test_anthropic_live_stream_equals_the_whole_turn(stack) -> None:
    replica, proxy, record_dir = stack
    session = f"claude-{uuid.uuid4().hex[:6]}"
    api = anthropic.Anthropic(base_url=proxy.url, api_key="k", default_headers={"x-session-id": session})
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = api.messages.create(model=MODEL, max_tokens=256, tools=ANTHROPIC_TOOLS, messages=messages)
    with api.messages.stream(model=MODEL, max_tokens=256, tools=ANTHROPIC_TOOLS, messages=messages) as stream:
        assert stream.response.headers["x-tito-stream"] == "live"
        live = stream.get_final_message()
    turns = turns_of(record_dir, session)
    assert len(turns) == 2 and turns[0].completion_ids == turns[1].completion_ids
    assert turns[0].prompt_added_ids == turns[1].prompt_added_ids
    assert [(b.type, getattr(b, "input", None)) for b in live.content] == [
        (b.type, getattr(b, "input", None)) for b in whole.content
    ]
    assert live.usage.output_tokens == len(turns[1].completion_ids) and live.stop_reason == whole.stop_reason
    # The streamed tool ids are the committed ones: echoing the streamed message continues the turn.
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in live.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "21 C"}
                                     for b in live.content if b.type == "tool_use"]},
    ]  # fmt: skip
    api.messages.create(model=MODEL, max_tokens=256, tools=ANTHROPIC_TOOLS, messages=messages)
    assert turns_of(record_dir, session)[2].parent_turn_id == 1


def test_responses_live_stream_equals_the_whole_turn(stack) -> None:
    replica, proxy, record_dir = stack
    session = f"codex-{uuid.uuid4().hex[:6]}"
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session})
    items = [{"role": "user", "content": "Weather in Oslo?"}]
    whole = api.responses.create(model=MODEL, input=items, tools=RESPONSES_TOOLS)
    with api.responses.stream(model=MODEL, input=items, tools=RESPONSES_TOOLS) as stream:
        live = stream.get_final_response()
    turns = turns_of(record_dir, session)
    assert len(turns) == 2 and turns[0].completion_ids == turns[1].completion_ids
    assert [i.type for i in live.output] == [i.type for i in whole.output]
    call = next(i for i in live.output if i.type == "function_call")
    assert turns[1].assistant_message["tool_calls"][0]["id"] == call.call_id
    follow = api.responses.create(
        model=MODEL, previous_response_id=live.id, tools=RESPONSES_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
    )  # fmt: skip
    assert follow.output_text and turns_of(record_dir, session)[2].parent_turn_id == 1
    raw = post(proxy.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True},
               headers={"x-session-id": session})  # fmt: skip
    assert raw.headers["x-tito-stream"] == "live"
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"


def test_errors_before_the_first_event_are_in_the_apis_shape(stack) -> None:
    replica, proxy, record_dir = stack
    session = f"early-{uuid.uuid4().hex[:6]}"
    replica.set_faults(["render:http400"])
    reply = post(proxy.url + "/v1/messages", json={"model": MODEL, "max_tokens": 9, "stream": True,
                 "messages": [{"role": "user", "content": "Hi"}]}, headers={"x-session-id": session})  # fmt: skip
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    replica.set_faults(["render:http400"])
    reply = post(proxy.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True},
                 headers={"x-session-id": session})  # fmt: skip
    assert reply.status_code == 400 and "error" in reply.json()
    assert turns_of(record_dir, session) == []


def test_a_failure_mid_stream_is_the_apis_error_event_and_records_nothing(stack) -> None:
    replica, proxy, record_dir = stack
    session = f"mid-{uuid.uuid4().hex[:6]}"
    replica.set_faults(["generate:logprobs_length"])
    reply = post(proxy.url + "/v1/messages", json={"model": MODEL, "max_tokens": 64, "stream": True,
                 "messages": [{"role": "user", "content": "Hi"}]}, headers={"x-session-id": session})  # fmt: skip
    assert reply.text.startswith("event: message_start")
    last = reply.text.strip().split("\n\n")[-1]
    assert last.startswith("event: error") and "nothing was recorded" in last and "message_stop" not in reply.text
    replica.set_faults(["generate:logprobs_length"])
    reply = post(proxy.url + "/v1/responses", json={"model": MODEL, "input": "Hi", "stream": True},
                 headers={"x-session-id": session})  # fmt: skip
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.failed"
    assert "nothing was recorded" in events[-1]["response"]["error"]["message"]
    assert turns_of(record_dir, session) == []


def test_stop_reasons_and_incomplete_responses(stack) -> None:
    replica, proxy, record_dir = stack
    api = anthropic.Anthropic(base_url=proxy.url, api_key="k")
    cut = api.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Tell me about Oslo."}])
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    responses = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k")
    short = responses.responses.create(model=MODEL, input="Tell me about Lima.", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
