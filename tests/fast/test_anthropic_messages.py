"""Anthropic Messages through a real mitmdump, with the real anthropic SDK as the agent: token-exact turns, the
reply and stream shapes the SDK accumulates, count_tokens, message identity across what Claude Code changes between
requests, signatures, and errors in Anthropic's own shape."""

from __future__ import annotations

import json

import anthropic
import pytest
from support.anthropic_agent import TOOLS, echo, tool_results
from support.basics import tokenizer_path
from support.proxy_harness import post
from support.token_exact import assert_token_exact, recorded

from tito_addon.engine.tokenizer_loading import load_tokenizer

IMG = "iVBORw0KGgo="
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=sdk-cli;"},
    {"type": "text", "text": "You are a careful agent.", "cache_control": {"type": "ephemeral"}},
]


def client(proxy, **headers: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", default_headers=headers, max_retries=0)


def test_tool_loop_and_a_second_user_turn_are_token_exact(proxy, replica) -> None:
    api = client(proxy)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    replies = []
    for _ in range(2):  # two tool round trips
        reply = api.messages.create(model="qwen3", max_tokens=512, system=SYSTEM, tools=TOOLS, messages=messages)
        replies.append(reply)
        assert reply.stop_reason == "tool_use"
        assert reply.id.startswith("msg_")
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses and all(b.id.startswith("toolu_") and b.name in ("get_weather", "get_time") for b in uses)
        messages += [echo(reply), tool_results(reply)]
        answer = api.messages.create(model="qwen3", max_tokens=512, system=SYSTEM, tools=TOOLS, messages=messages)
        replies.append(answer)
        assert answer.stop_reason == "end_turn"
        assert [b.type for b in answer.content] == ["thinking", "text"]
        messages += [echo(answer), {"role": "user", "content": [{"type": "text", "text": "And in Rome?"}]}]
    turns = assert_token_exact(proxy.record_dir, replica)
    assert len(turns) == 4 and len({t.session_id for t in turns}) == 1
    assert [t.parent_turn_id for t in turns] == [None, 0, 1, 2]
    assert all(t.api == "anthropic_messages" for t in turns)
    assert [t.reply_id for t in turns] == [r.id for r in replies]
    for reply, turn in zip(replies, turns, strict=True):
        assert reply.usage.input_tokens == turn.prompt_len
        assert reply.usage.output_tokens == len(turn.completion_ids)
    # The billing block never reaches the model; the record says it was left out.
    first_prompt = replica.generated()[0]["prompt_ids"]
    text = load_tokenizer(tokenizer_path("qwen3"), trust_remote_code=False).decode(first_prompt)
    assert "x-anthropic-billing-header" not in text and "You are a careful agent." in text
    assert turns[0].left_out == ["system: the x-anthropic-billing-header block"]
    # The appended items are kept in Anthropic's own form as well as the canonical one.
    assert turns[1].appended_items == [messages[2]] and messages[2]["content"][0]["type"] == "tool_result"
    assert [m["role"] for m in turns[1].appended_messages] == ["tool"] * len(messages[2]["content"])


def test_stream_accumulates_to_the_same_message_as_create(proxy, replica) -> None:
    api = client(proxy)
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    whole = api.messages.create(model="qwen3", max_tokens=512, tools=TOOLS, messages=messages)
    with api.messages.stream(model="qwen3", max_tokens=512, tools=TOOLS, messages=messages) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_stop" in events
    strip = {"id"}

    def shape(message) -> list[dict]:
        blocks = []
        for block in message.content:
            dumped = block.model_dump(exclude_none=True)
            blocks.append({k: v for k, v in dumped.items() if k not in strip and k != "signature"})
        return blocks

    assert shape(streamed) == shape(whole)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    thinking = [b for b in streamed.content if b.type == "thinking"]
    assert thinking and thinking[0].signature.startswith("tito1.")
    # The streamed turn continues like any other: tool results on it extend its exact ids.
    messages += [echo(streamed), tool_results(streamed)]
    api.messages.create(model="qwen3", max_tokens=512, tools=TOOLS, messages=messages)
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, None, 1]


def test_count_tokens_is_the_exact_prompt_length_of_the_turn(proxy, replica) -> None:
    api = client(proxy)
    messages = [{"role": "user", "content": "What is the weather in Lima?"}]
    counted = api.messages.count_tokens(model="qwen3", system=SYSTEM, tools=TOOLS, messages=messages)
    assert replica.generated() == []  # answered from our own render, never forwarded
    reply = api.messages.create(model="qwen3", max_tokens=256, system=SYSTEM, tools=TOOLS, messages=messages)
    assert counted.input_tokens == reply.usage.input_tokens == len(replica.generated()[0]["prompt_ids"])
    messages += [echo(reply), tool_results(reply)]
    counted = api.messages.count_tokens(model="qwen3", system=SYSTEM, tools=TOOLS, messages=messages)
    reply = api.messages.create(model="qwen3", max_tokens=256, system=SYSTEM, tools=TOOLS, messages=messages)
    assert counted.input_tokens == reply.usage.input_tokens == len(replica.generated()[1]["prompt_ids"])
    assert len(recorded(proxy.record_dir)) == 2


def test_what_claude_code_changes_between_requests_is_not_identity(proxy, replica) -> None:
    """cache_control markers move, a lone text block collapses to a string, system entries appear inside messages:
    the next request still extends the stored turn exactly."""
    api = client(proxy)
    first_user = {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
            {"type": "text", "text": "Weather in Kyiv?", "cache_control": {"type": "ephemeral"}},
        ],
    }
    reply = api.messages.create(model="qwen3", max_tokens=256, system=SYSTEM, tools=TOOLS, messages=[first_user])
    moved = {"role": "user", "content": [dict(b) for b in first_user["content"]]}
    del moved["content"][1]["cache_control"]
    assistant = echo(reply)
    assistant["content"][-1]["cache_control"] = {"type": "ephemeral"}
    results = tool_results(reply)
    results["content"][0]["content"] = [{"type": "text", "text": results["content"][0]["content"]}]
    environment = {"role": "system", "content": "Working directory: /tmp/project"}
    api.messages.create(
        model="qwen3", max_tokens=256, system=SYSTEM[1:] + [], tools=TOOLS,
        messages=[moved, assistant, results, environment, {"role": "user", "content": "Thanks."}],
    )  # fmt: skip
    turns = assert_token_exact(proxy.record_dir, replica)
    # The billing block is gone from the second request's system too: the same system message either way.
    assert [t.parent_turn_id for t in turns] == [None, 0]
    assert [m["role"] for m in turns[1].appended_messages] == ["tool", "system", "user"]


def test_a_changed_thinking_block_is_a_new_branch_and_a_forged_signature_plain_text(proxy, replica) -> None:
    api = client(proxy, **{"x-session-id": "signatures"})
    messages = [{"role": "user", "content": "Weather in Quito?"}]
    reply = api.messages.create(model="qwen3", max_tokens=256, tools=TOOLS, messages=messages)
    forged = echo(reply)
    thinking = forged["content"][0]
    assert thinking["type"] == "thinking"
    thinking["signature"] = "tito1.bm90LW91cnM.AAAAAAAAAAAAAAAAAAAAAAAA"
    api.messages.create(model="qwen3", max_tokens=256, tools=TOOLS, messages=[*messages, forged, tool_results(reply)])
    edited = echo(reply)
    edited["content"][0]["thinking"] += " (edited)"
    api.messages.create(model="qwen3", max_tokens=256, tools=TOOLS, messages=[*messages, edited, tool_results(reply)])
    turns = assert_token_exact(proxy.record_dir, replica)
    # Same text, forged signature: the text is what it claims, so the stored ids still hold (a continuation).
    assert turns[1].parent_turn_id == 0
    assert any("thinking signature that is not ours" in note for note in turns[1].left_out or [])
    # Edited thinking cannot extend the stored ids: a fresh render, a new root of the session.
    assert turns[2].parent_turn_id is None and turns[2].session_id == turns[0].session_id


def test_bad_requests_are_anthropic_errors_and_change_nothing(proxy, replica) -> None:
    api = client(proxy)
    cases = [
        {"model": "qwen3", "max_tokens": 10, "messages": []},
        {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
        {"model": "qwen3", "max_tokens": 10, "messages": [{"role": "robot", "content": "hi"}]},
        {"model": "qwen3", "max_tokens": 10, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
        {
            "model": "qwen3",
            "max_tokens": 10,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
                    ],
                }
            ],
        },
        {"model": "qwen3", "max_tokens": 10, "messages": [{"role": "assistant", "content": [{"type": "tool_use"}]}]},
    ]
    for body in cases:
        reply = post(proxy.url + "/v1/messages", json=body, headers={"x-api-key": "sk-ant-client"})
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    with pytest.raises(anthropic.BadRequestError) as raised:
        api.messages.create(model="qwen3", max_tokens=10, messages=[{"role": "user", "content": [{"type": "nope"}]}])
    assert raised.value.status_code == 400 and raised.value.body["error"]["type"] == "invalid_request_error"
    assert replica.received() == [] and not list(proxy.record_dir.glob("*.jsonl"))


def test_an_upstream_failure_is_an_anthropic_error_and_records_nothing(proxy, replica) -> None:
    replica.set_faults(["http500"])
    api = client(proxy)
    with pytest.raises(anthropic.InternalServerError) as raised:
        api.messages.create(model="qwen3", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "api_error"
    assert not list(proxy.record_dir.glob("*.jsonl"))
    reply = api.messages.create(model="qwen3", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert json.loads(next(proxy.record_dir.glob("*.jsonl")).read_text().splitlines()[0])["api"] == "anthropic_messages"


def test_session_scoped_base_urls_name_the_session(proxy, replica) -> None:
    """`/sessions/{id}/v1/messages` (and `?beta=true`, as Claude Code sends) names the session like the header."""
    api = anthropic.Anthropic(base_url=proxy.url + "/sessions/team%2Frun-7", api_key="sk-ant-client", max_retries=0)
    api.messages.create(model="qwen3", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    body = {"model": "qwen3", "max_tokens": 64, "messages": [{"role": "user", "content": "hello"}]}
    reply = post(proxy.url + "/sessions/team%2Frun-7/v1/messages?beta=true", json=body)
    assert reply.status_code == 200 and reply.headers["x-tito-session-id"] == "team/run-7"
    assert {t.session_id for t in recorded(proxy.record_dir)} == {"team/run-7"}
