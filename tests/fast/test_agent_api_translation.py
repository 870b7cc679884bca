"""The translations themselves, without a proxy: what each agent API's request becomes in the canonical chat form,
and how a finished turn's stop is told in Anthropic's terms (the replicas cannot end a turn on a stop string)."""

from __future__ import annotations

import json

import pytest

from tito_addon.protocols.agent_api import ReplyContext, TurnOutcome
from tito_addon.protocols.anthropic_messages import AnthropicMessagesApi
from tito_addon.protocols.openai_responses import OpenAIResponsesApi
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.sessions.message_keys import message_key
from tito_addon.tito_errors import BadRequest
from tito_addon.turns.turn_replies import matched_stop

SIGNER = TurnSigner(b"k" * 32)


def anthropic(body: dict) -> tuple:
    request = AnthropicMessagesApi(SIGNER).parse(json.dumps(body).encode())
    return request, [message_key(m) for m in request.chat.messages]


def test_anthropic_fields_become_the_chat_body() -> None:
    request, _ = anthropic(
        {
            "model": "m", "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
            "stop_sequences": ["END"], "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"},
            "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
            "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "ws"}],
            "messages": [{"role": "user", "content": "hi"}],
        }
    )  # fmt: skip
    body = request.chat_body
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False and body["stop"] == ["END"] and body["top_k"] == 20
    assert [t["function"]["name"] for t in body["tools"]] == ["f"]
    assert "metadata" not in body and request.thinking is False
    assert any("web_search_20250305" in note for note in request.dropped)
    any_choice, _ = anthropic({"model": "m", "max_tokens": 9, "tools": [{"name": "f"}], "tool_choice": {"type": "any"},
                               "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert any_choice.chat_body["tool_choice"] == "required"


def test_anthropic_forms_that_clients_alternate_are_one_message() -> None:
    plain = {"role": "user", "content": "Weather?"}
    blocks = {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]}
    result_text = {"type": "tool_result", "tool_use_id": "t1", "content": "21 C"}
    result_blocks = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "21 C"}],
                     "is_error": False}  # fmt: skip
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": 1, "a": [1, 2]}}
    assistant = {"role": "assistant", "content": [use]}
    one = anthropic({"model": "m", "max_tokens": 9, "messages": [plain, assistant, {"role": "user", "content": [
        result_text]}]})[1]  # fmt: skip
    two = anthropic({"model": "m", "max_tokens": 9, "messages": [blocks, assistant, {"role": "user", "content": [
        result_blocks]}]})[1]  # fmt: skip
    assert one == two


def test_anthropic_system_and_billing_header() -> None:
    request, _ = anthropic(
        {
            "model": "m", "max_tokens": 9,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
                       {"type": "text", "text": "Be kind."}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "env: /tmp"},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"},
                                                      {"type": "text", "text": "next"}]}],
        }
    )  # fmt: skip
    roles = [(m.role, m.text()) for m in request.chat.messages]
    assert roles == [("system", "Be kind."), ("user", "hi"), ("system", "env: /tmp"), ("tool", "r"), ("user", "next")]
    assert request.item_of == [0, 1, 2, 3, 3]


@pytest.mark.parametrize(
    ("matched", "stops", "finish", "calls", "expected"),
    [
        ("END", ["END"], "stop", False, ("stop_sequence", "END")),
        (151645, ["END"], "stop", False, ("end_turn", None)),
        (None, [], "length", False, ("max_tokens", None)),
        (None, [], "tool_calls", True, ("tool_use", None)),
        ("<|im_end|>", ["END"], "stop", False, ("end_turn", None)),
    ],
)
def test_anthropic_stop_reasons(matched, stops, finish, calls, expected) -> None:
    body = {
        "model": "m",
        "max_tokens": 9,
        "stop_sequences": stops or None,
        "messages": [{"role": "user", "content": "x"}],
    }
    request = AnthropicMessagesApi(SIGNER).parse(json.dumps({k: v for k, v in body.items() if v is not None}).encode())
    responder = AnthropicMessagesApi(SIGNER).responder(request, ReplyContext("msg_x", 5, SIGNER))
    agent_body = {"choices": [{"index": 0, "matched_stop": matched}]}
    message = {"role": "assistant", "content": "a", **({"tool_calls": [{"id": "c", "function": {"name": "f",
               "arguments": "{}"}}]} if calls else {})}  # fmt: skip
    outcome = TurnOutcome(message, finish, 5, 2, agent_body, None, matched_stop(agent_body), {})
    assert responder.stop(outcome) == expected
    vllm_body = {"choices": [{"index": 0, "stop_reason": matched}]}
    assert matched_stop(vllm_body) == (matched if isinstance(matched, str) else None)


def responses(body: dict):
    return OpenAIResponsesApi(SIGNER).parse(json.dumps(body).encode())


def test_responses_items_become_canonical_messages() -> None:
    request = responses(
        {
            "model": "m", "instructions": "Be brief.", "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                      {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "g"}]},
                      {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
                {"role": "user", "content": "Weather?"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Think."}]},
                {"type": "message", "role": "assistant", "id": "msg_client", "content": [
                    {"type": "output_text", "text": "Looking.", "annotations": []}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "g", "namespace": "mcp", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one", "id": "fco_x"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            ],
        }
    )  # fmt: skip
    messages = request.chat.messages
    assert [m.role for m in messages] == ["system", "system", "user", "assistant", "tool", "tool"]
    assistant = messages[3]
    assert assistant.text() == "Looking." and assistant.reasoning_text() == "Think."
    assert [(c.id, c.function.name) for c in assistant.tool_calls] == [("c1", "f"), ("c2", "mcp__g")]
    assert [t["function"]["name"] for t in request.chat_body["tools"]] == ["f", "mcp__g"]
    assert request.chat_body["response_format"]["json_schema"]["name"] == "w"
    assert request.thinking is False
    assert sum("web_search" in n or "custom" in n for n in request.dropped) == 2
    assert request.item_of == [0, 1, 2, 3, 7, 8]  # instructions, then each message's first input item


def test_responses_identity_ignores_client_ids_and_argument_spelling() -> None:
    def keys(call_item: dict, output_id: str) -> list:
        request = responses(
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": "x"},
                    call_item,
                    {"type": "function_call_output", "call_id": "c", "output": "r", "id": output_id},
                ],
            }
        )
        return [message_key(m) for m in request.chat.messages]  # fmt: skip

    one = keys({"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": 1, "b": [1, 2]}'}, "fco_1")
    two = keys({"type": "function_call", "id": "fc_9", "call_id": "c", "name": "f", "arguments": '{"b":[1,2],"a":1}'},
               "fco_2")  # fmt: skip
    assert one == two


def test_an_unknown_item_or_block_type_is_named_not_the_first_member_of_a_union() -> None:
    """`input` is a string or a list of items: the refusal names the item that is wrong, never `input.str`."""
    item = {"type": "some_new_item", "tools": []}
    with pytest.raises(BadRequest, match=r"at input\.1: Input tag 'some_new_item' found using 'type'") as refused:
        responses({"model": "m", "input": [{"role": "user", "content": "x"}, item]})
    assert "str" not in refused.value.message.split(":")[0]
    with pytest.raises(BadRequest, match=r"at input\.0\.function_call\.arguments: Field required"):
        responses({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]})
    blocks = [{"type": "text", "text": "hi"}, {"type": "some_new_block"}]
    with pytest.raises(BadRequest, match=r"at messages\.0\.content\.1: Input tag 'some_new_block'"):
        AnthropicMessagesApi(SIGNER).parse(
            json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": blocks}]}).encode()
        )


@pytest.mark.parametrize(
    "item",
    [
        {"type": "additional_tools", "id": "at_1", "role": "developer", "tools": [{"type": "namespace",
         "name": "functions", "tools": [{"type": "custom", "name": "exec", "format": {"type": "grammar"}}]}]},
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "c", "name": "apply_patch",
         "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c", "output": "Success."},
    ],
)  # fmt: skip
def test_codex_items_without_a_chat_form_name_the_item_and_the_codex_setting(item: dict) -> None:
    with pytest.raises(BadRequest) as refused:
        responses({"model": "gpt-5.6", "input": [{"role": "user", "content": "x"}, item]})
    message = refused.value.message
    assert message.startswith(f"invalid responses request at input.1: {item['type']!r} items are not supported")
    assert "codex exec -m qwen3" in message and "Nothing was forwarded" in message


def test_responses_refusals() -> None:
    with pytest.raises(BadRequest):
        responses({"model": "m", "input": "x", "tools": [{"type": "function"}]})
    with pytest.raises(BadRequest):
        responses({"model": "m", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})
