"""A request that begins with the bytes of one read before parses only what follows them
(protocols/known_requests.py): it reads exactly as a parse of the whole body would, the same validated request,
the same object, the same 400 with the same words, whatever bytes follow the known prefix."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.basics import examples

from tito_addon.protocols.known_messages import KnownMessages
from tito_addon.protocols.known_requests import MIN_PREFIX, STEP, KnownRequests
from tito_addon.protocols.openai_chat import ChatCompletionsApi
from tito_addon.protocols.routing import agent_apis
from tito_addon.protocols.turn_refs import TurnSigner
from tito_addon.sessions.message_keys import message_key
from tito_addon.tito_errors import BadRequest

API = ChatCompletionsApi()
SYSTEM = {"role": "system", "content": "You are a data agent. " * 4}
RESULT = " ".join(f"row {i}: value={i * 37 % 1000} status=ok" for i in range(40))


def compact(obj: dict) -> bytes:
    """A body as openai-python and most agents write it: compact, UTF-8 as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# How clients write a body: compact as openai-python, httpx and Node do; spaced with ASCII escapes as Python's
# `json.dumps` does for requests and aiohttp; and the other two a Python client may choose.
WRITERS = {
    "compact": compact,
    "compact-ascii": lambda obj: json.dumps(obj, separators=(",", ":")).encode(),
    "spaced-ascii": lambda obj: json.dumps(obj).encode(),
    "spaced": lambda obj: json.dumps(obj, ensure_ascii=False).encode(),
}


def session(agent: int, turns: int, write=compact) -> list[bytes]:
    messages = [SYSTEM, {"role": "user", "content": f"Agent {agent}: go, Zürich."}]
    bodies = []
    for turn in range(turns):
        bodies.append(write({"model": "m", "messages": messages, "temperature": 0.5, "stream": False}))
        call = {"id": f"c{agent}-{turn}", "type": "function", "function": {"name": "query", "arguments": "{}"}}
        messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": f"{turn}: {RESULT}"}]  # fmt: skip
    return bodies


@pytest.fixture
def known(monkeypatch: pytest.MonkeyPatch) -> KnownRequests:
    requests = KnownRequests(64 * 1024 * 1024, min_prefix=0)
    monkeypatch.setattr(API, "known_requests", requests)
    monkeypatch.setattr(API, "known_messages", KnownMessages())
    return requests


def read(data: bytes) -> tuple[object, object, list[bytes] | None] | str:
    """The request as validated, the object forwarded and the keys; or the refusal's words."""
    try:
        request, obj = API.parse_request(data)
    except BadRequest as exc:
        return str(exc)
    return request.model_dump(), obj, [message_key(m) for m in request.messages]


def read_whole(data: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[object, object, list[bytes] | None] | str:
    with monkeypatch.context() as patch:
        patch.setattr(API, "known_requests", KnownRequests(0))
        patch.setattr(API, "known_messages", KnownMessages(budget_bytes=0))
        return read(data)


@pytest.mark.parametrize("style", WRITERS)
def test_each_turn_of_a_session_parses_only_what_was_appended(
    style: str, known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In whichever style the agent's client writes JSON: a spaced body read whole every turn cost ~12 ms at turn
    200 (issue 42)."""
    # neither the memo nor a whole read falls back to the strict parse for a body its client wrote
    monkeypatch.setattr("tito_addon.protocols.json_body._parse_strict", lambda body: pytest.fail("read strictly"))
    bodies = session(0, 12, WRITERS[style])
    assert len(bodies[-1]) > 3 * STEP, "the last requests span several index steps"
    previous = None
    for body in bodies:
        request, _ = API.parse_request(body)
        if previous is not None:
            assert all(a is b for a, b in zip(previous.messages, request.messages, strict=False)), "read once"
        assert read(body) == read_whole(body, monkeypatch)
        previous = request
    # every body after the first twice (parse + read), the first once (its read)
    assert known.hits == 2 * (len(bodies) - 1) + 1


def test_many_agents_with_the_same_system_prompt_each_find_their_own_request(
    known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = [session(agent, 6) for agent in range(12)]
    previous: dict[int, object] = {}
    for turn in range(6):
        for agent, bodies in enumerate(sessions):
            hits = known.hits
            request, _ = API.parse_request(bodies[turn])
            if turn:
                assert known.hits == hits + 1
                earlier = previous[agent].messages  # type: ignore[attr-defined]
                assert all(a is b for a, b in zip(earlier, request.messages, strict=False)), "its own request"
            previous[agent] = request
            assert read(bodies[turn]) == read_whole(bodies[turn], monkeypatch)


def test_a_retry_of_the_same_request_is_a_hit_and_remembered_once(known: KnownRequests) -> None:
    body = session(0, 3)[-1]
    first, _ = API.parse_request(body)
    again, _ = API.parse_request(body)
    assert known.hits == 1 and len(known) == 3, "the request, and it up to each of its last two messages"
    assert all(a is b for a, b in zip(first.messages, again.messages, strict=True))


def test_an_edited_history_is_parsed_whole(known: KnownRequests, monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = session(0, 4)
    API.parse_request(bodies[2])
    edited = bodies[3].replace(b"Agent 0: go", b"Agent 0: Go")
    assert read(edited) == read_whole(edited, monkeypatch)
    assert known.hits == 0


# What may follow the bytes of a known request, up to the end of its last message.
FRAGMENTS = [
    ",", "]", "}", "{", " ", ":", '"model"', '"messages"', '"x"', '"n"', "2", "1e400", "-0", "1.0", str(2**70),
    "null", '"m"', "[]", '{"role":"user","content":"And Oslo?"}', '{"role":"robot","content":"x"}',
    '{"role":"user","content":"a","content":"b"}', '{"role":"user","content":"\\ud800"}', ',"temperature":0.5',
    ',"model":"other"', ',"stream":true', ',"messages":[]', '],"model":"m"}', '],"x":1}', "]}",
]  # fmt: skip


# The same, as a spaced client writes them.
SPACED_FRAGMENTS = [
    ", ", ": ", '{"role": "user", "content": "And Oslo?"}', '{"role": "user", "content": "\\u00e9t\\u00e9"}',
    '{"role": "user", "content": "été"}', '{"role":"user","content":"x"}', '{"role": "user", "content": "a", '
    '"content": "b"}', ', "temperature": 0.5', ', "model": "other"', '], "model": "m"}', '], "x": 1}', ' ]', "] }",
]  # fmt: skip


@settings(max_examples=examples(300), deadline=None)
@given(
    st.sampled_from(list(WRITERS)),
    st.lists(st.sampled_from(FRAGMENTS + SPACED_FRAGMENTS), max_size=8),
    st.sampled_from([",", ", ", "]", ""]),
)
def test_whatever_follows_a_known_prefix_reads_as_the_whole_body(style: str, fragments: list[str], first: str) -> None:
    prior = WRITERS[style]({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}]})
    end = prior.rindex(b"]")
    data = prior[:end] + (first + "".join(fragments)).encode()
    requests, messages = KnownRequests(1 << 20, min_prefix=0), KnownMessages()
    original = API.known_requests, API.known_messages
    try:
        API.known_requests, API.known_messages = requests, messages
        API.parse_request(prior)
        assert len(requests) >= 1
        with_memo = read(data)
        API.known_requests, API.known_messages = KnownRequests(0), KnownMessages(budget_bytes=0)
        assert with_memo == read(data), data
    finally:
        API.known_requests, API.known_messages = original


@settings(max_examples=examples(300), deadline=None)
@given(
    st.sampled_from(list(WRITERS)),
    st.lists(st.sampled_from(FRAGMENTS + SPACED_FRAGMENTS), max_size=8),
    st.sampled_from([",", ", ", "]", ""]),
)
def test_a_body_that_ends_with_the_known_requests_tail_reads_as_the_whole_body(
    style: str, fragments: list[str], first: str
) -> None:
    """The members after the messages (tools, sampling) sent again byte for byte are not parsed again: whatever
    comes between the known messages and that tail, the body reads as its whole parse does."""
    prior = WRITERS[style]({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}],
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"a": [1.5]}}}],
                            "temperature": 0.5})  # fmt: skip
    end = prior.rindex(b"]", 0, prior.index(b'"tools"'))  # the messages' closing bracket
    data = prior[:end] + (first + "".join(fragments)).encode() + prior[end:]
    requests, messages = KnownRequests(1 << 20, min_prefix=0), KnownMessages()
    original = API.known_requests, API.known_messages
    try:
        API.known_requests, API.known_messages = requests, messages
        API.parse_request(prior)
        extension = requests.extend(data)
        with_memo = read(data)
        API.known_requests, API.known_messages = KnownRequests(0), KnownMessages(budget_bytes=0)
        assert with_memo == read(data), data
        if extension is not None:
            assert extension.obj == json.loads(data)
    finally:
        API.known_requests, API.known_messages = original


def test_a_repeated_tail_is_read_without_parsing_it_again(
    known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    bodies = session(0, 2)
    API.parse_request(bodies[0])
    extension = known.extend(bodies[1])
    assert extension is not None and extension.only_appended_new
    assert extension.obj == json.loads(bodies[1])
    # Another tail after the same messages: read the general way, as its whole parse.
    changed = bodies[1].replace(b'"temperature":0.5', b'"temperature":0.7')
    other = known.extend(changed)
    assert other is not None and not other.only_appended_new and other.obj == json.loads(changed)
    # A message appended too deep is still refused, in the whole parse's words.
    cut = bodies[1].rindex(b'],"temperature"')
    deep = bodies[1][:cut] + b',{"role":"user","content":"x","n":' + b"[" * 200 + b"]" * 200 + b"}" + bodies[1][cut:]
    assert known.extend(deep) is not None
    assert isinstance(read(deep), str) and read(deep) == read_whole(deep, monkeypatch)


@pytest.mark.parametrize(
    "after",
    [
        b'],"model":"x"}',  # a member sent before the messages, sent again after them
        b",]}",  # a trailing comma
        b',{"role":"user","content":"x","n":1e400}]}',
        b',{"role":"user","content":"x"}],"messages":[]}',
        b', {"role":"user","content":"x"}]}',  # not compact: parsed whole, and accepted
    ],
)
def test_what_the_strict_parse_refuses_is_still_refused(
    after: bytes, known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    prior = compact({"model": "m", "messages": [SYSTEM, {"role": "user", "content": "Weather in Zürich?"}]})
    API.parse_request(prior)
    data = prior[: prior.rindex(b"]")] + after
    assert read(data) == read_whole(data, monkeypatch)
    if after.startswith(b", "):
        assert not isinstance(read(data), str)
    else:
        assert isinstance(read(data), str)


def test_bounded_and_an_extended_request_is_forgotten_first(known: KnownRequests) -> None:
    bodies = session(0, 8)
    other = [body.replace(b"a data agent", b"a file agent") for body in session(1, 2)]  # no common message
    API.parse_request(other[0])
    API.parse_request(bodies[0])
    API.parse_request(bodies[1])  # extends bodies[0], which goes to the cold end
    assert known.hits == 1
    entries = len(known)
    room = known.used_bytes - 1
    known.resize(room)
    assert known.used_bytes <= room and len(known) == entries - 1
    API.parse_request(other[1])
    assert known.hits == 2, "the other agent's request was kept, the extended one dropped"
    for body in bodies[2:]:
        API.parse_request(body)
        assert known.used_bytes <= room
    known.resize(64 * 1024 * 1024)
    for body in bodies[2:]:
        API.parse_request(body)
    assert known.hits >= 2 + len(bodies[2:]) - 1, "each later request extends the one before, once remembered"


def test_short_requests_are_parsed_whole_and_long_ones_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = KnownRequests(64 * 1024 * 1024)
    monkeypatch.setattr(API, "known_requests", requests)
    bodies = session(0, 12)
    for body in bodies:
        API.parse_request(body)
    long = [body for body in bodies if len(body) > MIN_PREFIX + 2 * len(RESULT)]
    assert long and len(long) < len(bodies)
    assert requests.hits >= len(long) - 1
    assert all(len(known.prefix) >= MIN_PREFIX for known in requests._entries.values())


def test_a_last_message_that_changes_on_the_next_turn_still_leaves_a_known_prefix(
    known: KnownRequests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that marks its newest message for prompt caching (`cache_control`, as Anthropic-minded clients do
    on chat too) changes the previous request's last message on every turn."""
    for body in session(0, 8):
        obj = json.loads(body)
        last = obj["messages"][-1]
        obj["messages"][-1] = {**last, "content": [{"type": "text", "text": last["content"],
                                                    "cache_control": {"type": "ephemeral"}}]}  # fmt: skip
        marked = compact(obj)
        assert read(marked) == read_whole(marked, monkeypatch)
    assert known.hits == 7


def test_each_api_owns_its_memos_with_a_budget_kept_warm_across_a_rebuild_with_its_signer() -> None:
    signer = TurnSigner(b"k" * 32)
    apis = agent_apis(signer, memo_bytes=1 << 20)
    assert {memo.budget_bytes for api in apis for memo in api.memos} == {1 << 20}
    assert len({id(memo) for api in apis for memo in api.memos}) == 5, "no memo is shared between APIs"
    chat = apis[0]
    for body in session(0, 8):
        chat.parse(body)
    remembered = len(chat.known_requests)
    assert remembered and len(chat.known_messages)
    again = agent_apis(signer, memo_bytes=2 << 20, warm=apis)
    assert [a is b for a, b in zip(apis, again, strict=True)] == [True] * 4, "the same APIs, memos warm"
    assert {memo.budget_bytes for api in again for memo in api.memos} == {2 << 20}
    assert len(chat.known_requests) == remembered
    other = agent_apis(TurnSigner(b"k" * 32), warm=apis)
    assert other[0] is chat, "chat reads no signed value: kept whatever the signer"
    assert all(a is not b for a, b in zip(apis[1:], other[1:], strict=True)), "what a signer opened stays its own"
    chat.resize_memos(0)
    assert len(chat.known_requests) == len(chat.known_messages) == 0
