"""An Anthropic Messages request that extends one read before translates only its appended messages
(protocols/translated_api.py, each message's `ItemTranslation`): it reads exactly as the whole request does, the
same canonical messages and chat body, the same native items, the same notes on what was left out (thinking
signatures that are not ours included), the same refusal with the same words."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.agent_reads import agent_read
from support.basics import examples

from tito_addon.protocols import anthropic_messages
from tito_addon.protocols.anthropic_messages import AnthropicMessagesApi
from tito_addon.protocols.known_requests import KnownRequests
from tito_addon.protocols.turn_refs import TurnSigner

SIGNER = TurnSigner(b"k" * 32)
API = AnthropicMessagesApi(SIGNER)
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2"},
    {"type": "text", "text": "You are Claude Code. " * 200},
]
TOOLS = [{"name": "Bash", "description": "Run a command.", "input_schema": {"type": "object"}}]
RESULT = "drwxr-xr-x  2 root root 4096 Nov 30 12:00 src\n" * 30


def compact(obj: dict) -> bytes:
    """As Claude Code writes a request: compact JSON, messages before system and tools."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def assistant(turn: int, signature: str) -> dict:
    thinking = f"I should list the files ({turn})."
    signed = SIGNER.sign_text(anthropic_messages.THINKING_PURPOSE, f"msg_{turn}", thinking)
    blocks = [{"type": "thinking", "thinking": thinking, "signature": signed if signature == "ours" else "forged"}]
    if turn % 3 == 1:
        blocks.append({"type": "redacted_thinking", "data": "abc"})
    blocks.append({"type": "tool_use", "id": f"toolu_{turn}", "name": "Bash", "input": {"command": "ls"}})
    return {"role": "assistant", "content": blocks}


def spaced(obj: dict) -> bytes:
    """As a Python agent on requests or aiohttp writes it: `json.dumps`, spaced, non-ASCII escaped."""
    return json.dumps(obj).encode()


def session(turns: int, write=compact) -> list[bytes]:
    messages: list[dict] = [
        {"role": "user", "content": [{"type": "text", "text": "Fix the build, Zürich team."}]},
    ]
    bodies = []
    for turn in range(turns):
        body = {"model": "claude", "messages": messages, "system": SYSTEM, "tools": TOOLS, "max_tokens": 4096,
                "stream": True}  # fmt: skip
        bodies.append(write(body))
        answer = assistant(turn, "forged" if turn % 4 == 2 else "ours")
        if turn % 5 == 3:
            answer = {"role": "assistant", "content": f"Plain answer {turn}."}  # keeps the newest signatures
        result = {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"{turn}\n{RESULT}"}
        messages = [*messages, answer, {"role": "user", "content": [result]}]
        if turn % 6 == 4:
            messages.append({"role": "system", "content": f"Environment changed ({turn})."})
    return bodies


def read(data: bytes) -> tuple | str:
    return agent_read(API, data)


def read_whole(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple | str:
    with monkeypatch.context() as patch:
        patch.setattr(API, "known_requests", KnownRequests(0))
        return read(data)


@pytest.fixture
def known(monkeypatch: pytest.MonkeyPatch) -> KnownRequests:
    requests = KnownRequests(64 * 1024 * 1024, min_prefix=0)
    monkeypatch.setattr(API, "known_requests", requests)
    return requests


@pytest.mark.parametrize("write", [compact, spaced], ids=["compact", "spaced-ascii"])
def test_each_turn_translates_only_what_was_appended(
    write, known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    bodies = session(14, write)
    previous = None
    forged = 0
    for turn, body in enumerate(bodies):
        request = API.parse(body)
        forged += any("not ours" in note for note in request.dropped)
        if turn >= 2:  # (the first request's messages end too early in its body to be remembered)
            pairs = zip(previous.chat.messages[1:], request.chat.messages[1:], strict=False)  # after `system`
            assert all(a is b for a, b in pairs), "the earlier messages are the ones validated then"
        assert read(body) == read_whole(body, monkeypatch)
        previous = request
    assert known.hits == 2 * (len(bodies) - 2) + 1
    assert forged >= 3, "the turns whose newest signatures are forged say so, as a whole read does"


def test_a_retry_and_an_edited_history(known: KnownRequests, monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = session(6)
    API.parse(bodies[4])
    assert read(bodies[4]) == read_whole(bodies[4], monkeypatch) and known.hits == 1
    edited = bodies[5].replace(b"Fix the build", b"Fix the tests")
    assert read(edited) == read_whole(edited, monkeypatch) and known.hits == 1


APPENDED = st.sampled_from(
    [
        '{"role":"user","content":"And now?"}',
        '{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AA"}}]}',
        '{"role":"robot","content":"x"}',
        '{"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"forged"}]}',
        '{"role":"assistant","content":"plain"}',
        '{"role":"system","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]}',
        '{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_0","content":[{"type":"text","text":"ok"}]}]}',
        '{"role":"user","content":"x","n":1e400}',
    ]
)  # fmt: skip
TAILS = st.sampled_from(
    [
        '],"system":"Be brief.","max_tokens":10}',
        '],"max_tokens":10,"model":"other"}',
        '],"max_tokens":0}',
        '],"tools":[{"name":""}],"max_tokens":10}',
        "]}",
        '],"max_tokens":10,"thinking":{"type":"enabled","budget_tokens":1024}}',
    ]
)


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(APPENDED, max_size=3), TAILS)
def test_whatever_is_appended_reads_as_the_whole_request(appended: list[str], tail: str) -> None:
    prior = session(3)[-1]
    end = prior.index(b'],"system"')
    data = prior[:end] + "".join("," + item for item in appended).encode() + tail.encode()
    original = API.known_requests
    try:
        API.known_requests = requests = KnownRequests(1 << 24, min_prefix=0)
        API.parse(prior)
        with_memo = read(data)
        assert requests.hits <= 1
        API.known_requests = KnownRequests(0)
        assert with_memo == read(data), data[end - 20 :]
    finally:
        API.known_requests = original


def with_marker(messages: list[dict]) -> list[dict]:
    """As Claude Code sends a history: a `cache_control` marker on the newest block only (a plain string becomes
    one text block to carry it)."""
    *earlier, last = messages
    content = last["content"]
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else [dict(b) for b in content]
    blocks[-1]["cache_control"] = {"type": "ephemeral"}
    return [*earlier, {**last, "content": blocks}]


def test_a_marker_that_moves_to_the_newest_block_still_leaves_a_known_prefix(
    known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = [json.loads(body)["messages"] for body in session(10)]
    bodies = [compact({"model": "claude", "max_tokens": 4096, "system": SYSTEM, "messages": with_marker(messages),
                       "tools": TOOLS, "stream": True}) for messages in clean]  # fmt: skip
    for body in bodies:
        assert read(body) == read_whole(body, monkeypatch)
    # each request changes its predecessor's last message: found up to the message before it (from the third on:
    # the first request has only the message that changes)
    assert known.hits == len(bodies) - 2
    assert all(len(entry.raw_messages) >= 1 for entry in known._entries.values())
