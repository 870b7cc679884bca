"""An OpenAI Responses request that extends one read before translates only its appended items
(openai_responses_translation.TranslatedItems): it reads exactly as the whole request does, the same canonical
messages and chat body, items, notes (sealed reasoning that is not ours included) and refusals; and an appended
item that joins the assistant message the known items left open is translated with them, as a whole read does."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.agent_reads import agent_read

from tito_addon.protocols.known_requests import KnownRequests
from tito_addon.protocols.openai_responses import OpenAIResponsesApi
from tito_addon.protocols.openai_responses_reply import REASONING_PURPOSE
from tito_addon.protocols.turn_refs import TurnSigner

SIGNER = TurnSigner(b"k" * 32)
API = OpenAIResponsesApi(SIGNER)
TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object"}},
         {"type": "web_search"}]  # fmt: skip
RESULT = "drwxr-xr-x  2 root root 4096 Nov 30 12:00 src\n" * 30


def compact(obj: dict) -> bytes:
    """As Codex writes a request (serde_json: compact, fields in declaration order)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def reasoning(turn: int, forged: bool) -> dict:
    text = f"I should run ls ({turn})."
    sealed = SIGNER.seal_text(REASONING_PURPOSE, f"resp_{turn}", text)
    return {"type": "reasoning", "id": f"rs_{turn}", "summary": [], "content": None,
            "encrypted_content": "gAAAforged" if forged else sealed}  # fmt: skip


def session(turns: int) -> list[bytes]:
    items: list[dict] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the build, Zürich."}]},
    ]
    bodies = []
    for turn in range(turns):
        body = {"model": "codex", "instructions": "You are Codex. " * 300, "input": items, "tools": TOOLS,
                "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium"},
                "store": False, "stream": True, "include": ["reasoning.encrypted_content"]}  # fmt: skip
        bodies.append(compact(body))
        call = {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": f"call_{turn}"}
        new = [reasoning(turn, forged=turn % 4 == 2), call,
               {"type": "function_call_output", "call_id": f"call_{turn}", "output": f"{turn}\n{RESULT}"}]  # fmt: skip
        if turn % 5 == 3:
            new.insert(1, {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": f"Running ls ({turn})."}]})  # fmt: skip
        items = [*items, *new]
    return bodies


def read(data: bytes) -> tuple | str:
    return agent_read(API, data)


def read_whole(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple | str:
    with monkeypatch.context() as patch:
        patch.setattr(API, "known_requests", KnownRequests(0, member="input"))
        return read(data)


@pytest.fixture
def known(monkeypatch: pytest.MonkeyPatch) -> KnownRequests:
    requests = KnownRequests(64 * 1024 * 1024, min_prefix=0, member="input")
    monkeypatch.setattr(API, "known_requests", requests)
    return requests


def test_each_turn_translates_only_what_was_appended(known: KnownRequests, monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = session(14)
    previous = None
    forged = 0
    for turn, body in enumerate(bodies):
        request = API.parse(body)
        forged += any("not ours" in note for note in request.dropped)
        if turn >= 1:
            pairs = zip(previous.chat.messages[1:], request.chat.messages[1:], strict=False)  # after instructions
            assert all(a is b for a, b in pairs), "the earlier messages are the ones validated then"
        assert read(body) == read_whole(body, monkeypatch)
        previous = request
    assert known.hits == 2 * (len(bodies) - 1) + 1
    assert forged == len(bodies) - 3, "every turn after the first forged reasoning notes it, as a whole read does"


def test_an_item_that_joins_the_open_assistant_message_is_read_whole(
    known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = json.loads(session(3)[-1])
    body["input"] = body["input"][:-1]  # ends on the function call: the assistant message is open
    open_ended = compact(body)
    API.parse(open_ended)
    joined = open_ended[: open_ended.rindex(b'],"tools"')] + (
        b',{"type":"function_call","name":"shell","arguments":"{}","call_id":"call_x"}' + open_ended[
            open_ended.rindex(b'],"tools"') :]
    )  # fmt: skip
    request = API.parse(joined)
    assert len(request.chat.messages[-1].tool_calls) == 2, "one assistant message with both calls"
    assert read(joined) == read_whole(joined, monkeypatch)
    assert known.hits == 2, "found, then translated whole (and the retry of it found again)"


APPENDED = st.sampled_from(
    [
        '{"type":"message","role":"user","content":[{"type":"input_text","text":"And now?"}]}',
        '{"role":"user","content":"easy message"}',
        '{"type":"message","role":"user","content":[{"type":"input_image","image_url":"x"}]}',
        '{"type":"message","role":"robot","content":"x"}',
        '{"type":"reasoning","summary":[{"type":"summary_text","text":"s"}],"encrypted_content":"forged"}',
        '{"type":"function_call","name":"shell","arguments":"{}","call_id":"c9"}',
        '{"type":"function_call_output","call_id":"c9","output":"ok"}',
        '{"type":"message","role":"assistant","content":[{"type":"output_text","text":"done"}]}',
        '{"type":"function_call_output","call_id":"c9","output":"x","n":1e400}',
    ]
)  # fmt: skip
TAILS = st.sampled_from(
    [
        '],"tools":[],"stream":false}',
        '],"model":"other"}',
        '],"previous_response_id":"resp_1"}',
        '],"max_output_tokens":-1}',
        "]}",
        '],"tools":[{"type":"function"}]}',
    ]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(APPENDED, max_size=3), TAILS, st.booleans())
def test_whatever_is_appended_reads_as_the_whole_request(appended: list[str], tail: str, open_run: bool) -> None:
    body = json.loads(session(3)[-1])
    if open_run:
        body["input"] = body["input"][:-1]
    prior = compact(body)
    end = prior.index(b'],"tools"')
    data = prior[:end] + "".join("," + item for item in appended).encode() + tail.encode()
    original = API.known_requests
    try:
        API.known_requests = KnownRequests(1 << 24, min_prefix=0, member="input")
        API.parse(prior)
        with_memo = read(data)
        API.known_requests = KnownRequests(0, member="input")
        assert with_memo == read(data), data[end - 20 :]
    finally:
        API.known_requests = original
