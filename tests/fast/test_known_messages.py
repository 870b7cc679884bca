"""The messages of earlier requests are not validated or keyed again (protocols/known_messages.py): a repeated
message is the object validated the first time, and every request reads exactly as it would without the memo:
the same validated request, the same keys, the same 400 with the same words."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tito_addon.canonical_chat import ChatMessage
from tito_addon.protocols.known_messages import KnownMessages, footprint
from tito_addon.protocols.openai_chat import ChatCompletionsApi
from tito_addon.sessions.message_keys import message_key
from tito_addon.tito_errors import BadRequest

API = ChatCompletionsApi()
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "21 °C"},
]  # fmt: skip


@pytest.fixture
def memo(monkeypatch: pytest.MonkeyPatch) -> KnownMessages:
    known = KnownMessages()
    monkeypatch.setattr(API, "known_messages", known)
    return known


def body(messages: list, **extra) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def read(data: bytes) -> tuple[object, list[bytes] | str]:
    """The request as validated and its keys, or the refusal's words."""
    try:
        request, _ = API.parse_request(data)
    except BadRequest as exc:
        return None, str(exc)
    return request.model_dump(), [message_key(m) for m in request.messages]


def without_memo(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[bytes] | str]:
    with monkeypatch.context() as patch:
        patch.setattr(API, "known_messages", KnownMessages(budget_bytes=0))
        return read(data)


def test_a_resent_history_is_the_objects_validated_before(memo: KnownMessages) -> None:
    first, _ = API.parse_request(body(HISTORY))
    keys = [message_key(m) for m in first.messages]
    second, _ = API.parse_request(body([*HISTORY, {"role": "user", "content": "And Oslo?"}]))
    assert all(a is b for a, b in zip(first.messages, second.messages, strict=False)), "validated once"
    assert memo.hits == len(HISTORY) and len(memo) == len(HISTORY) + 1
    assert [message_key(m) for m in second.messages][: len(HISTORY)] == keys
    fresh = [message_key(ChatMessage.model_validate(m)) for m in [*HISTORY, {"role": "user", "content": "And Oslo?"}]]
    assert [message_key(m) for m in second.messages] == fresh


@pytest.mark.parametrize(
    "changed",
    [
        {"role": "user", "content": "Weather in Zürich?", "x": 1e400},  # the known message with a non-finite field
        {"role": "user", "content": "Weather in Zürich?", "x": float("nan")},
        {"role": "robot", "content": "Weather in Zürich?"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "user", "content": "Weather in Zürich?", "x": 2**70},
        {"role": "user", "content": "\ud800"},
    ],
)
def test_a_request_reads_as_without_the_memo(
    changed: dict, memo: KnownMessages, monkeypatch: pytest.MonkeyPatch
) -> None:
    API.parse_request(body([*HISTORY, {"role": "user", "content": "Weather in Zürich?", "x": None}]))
    for data in (
        body([*HISTORY, changed]),
        body([changed, *HISTORY]),
        body(HISTORY, n=2),
        body(HISTORY, stream="yes"),
        body([*HISTORY, changed], tools=[{"type": "function"}]),
    ):
        data = data.replace(b"Infinity", b"1e400").replace(b"NaN", b"1e400")
        assert read(data) == without_memo(data, monkeypatch), data[:200]


def test_a_known_message_inside_a_too_deep_request_is_still_refused(
    memo: KnownMessages, monkeypatch: pytest.MonkeyPatch
) -> None:
    API.parse_request(body(HISTORY))
    deep: object = "x"
    for _ in range(120):
        deep = [deep]
    data = body([*HISTORY, {"role": "user", "content": "hi", "deep": deep}])
    _, words = read(data)
    assert isinstance(words, str) and "nested deeper" in words
    assert read(data) == without_memo(data, monkeypatch)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(range(len(HISTORY))), min_size=1, max_size=8), st.text(max_size=30))
def test_any_mix_of_known_and_new_messages_validates_as_a_whole(order: list[int], text: str) -> None:
    known = KnownMessages()
    original = API.known_messages
    API.known_messages = known
    try:
        API.parse_request(body(HISTORY))
        messages = [HISTORY[i] for i in order] + [{"role": "user", "content": text}]
        data = body(messages)
        with_memo = read(data)
        API.known_messages = KnownMessages(budget_bytes=0)
        assert with_memo == read(data)
    finally:
        API.known_messages = original


def test_the_memo_is_bounded_and_forgets_least_recently_used_first() -> None:
    messages = [{"role": "user", "content": f"message {i} " + "x" * 30} for i in range(5)]
    known = KnownMessages(budget_bytes=2 * footprint(KnownMessages.encoding(messages[0])) + 10)
    for raw in messages:
        known.remember(known.encoding(raw), raw, ChatMessage.model_validate(raw))
    assert known.used_bytes <= known.budget_bytes and len(known) == 2
    assert known.find(known.encoding(messages[0]), messages[0]) is None
    assert known.find(known.encoding(messages[4]), messages[4]) is not None


def test_validated_messages_cannot_change_and_a_changed_copy_is_keyed_anew() -> None:
    message = ChatMessage.model_validate({"role": "user", "content": "hi"})
    key = message_key(message)
    with pytest.raises(ValueError):
        message.content = "changed"  # type: ignore[misc]
    copy = message.model_copy(update={"content": "changed"})
    assert message_key(copy) != key and message_key(copy) == message_key(ChatMessage(role="user", content="changed"))
    assert message_key(message.model_copy()) == key
