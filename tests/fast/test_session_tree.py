"""Message matching and the session tree: deepest attachment, branches, reasoning tolerance."""

from __future__ import annotations

from tito_addon.canonical_chat import ChatMessage
from tito_addon.sessions.message_keys import message_key, reasoning_matches
from tito_addon.sessions.redis_tree import reasoning_digest
from tito_addon.sessions.session_tree import MemoryTree
from tito_addon.sessions.turn_entity import Turn


def M(**kw) -> ChatMessage:
    return ChatMessage.model_validate(kw)


def keys(messages):
    return [message_key(m) for m in messages]


def reasonings(messages):
    return [m.reasoning_text() if m.role == "assistant" else None for m in messages]


def test_empty_contents_are_equal_and_whitespace_is_significant() -> None:
    a = M(role="assistant", content=None, tool_calls=[{"id": "c1", "function": {"name": "f", "arguments": "{}"}}])
    b = M(role="assistant", content="", tool_calls=[{"id": "c1", "function": {"name": "f", "arguments": "{}"}}])
    c = M(role="assistant", content=[], tool_calls=[{"id": "c1", "function": {"name": "f", "arguments": "{}"}}])
    assert message_key(a) == message_key(b) == message_key(c)
    assert message_key(M(role="user", content="x\n\n")) != message_key(M(role="user", content="x\n"))
    assert message_key(M(role="user", content="x")) != message_key(M(role="system", content="x"))


def test_tool_calls_compare_by_id_name_and_parsed_arguments() -> None:
    def with_args(args, call_id="c1", name="f"):
        return M(role="assistant", tool_calls=[{"id": call_id, "type": "function", "index": 3,
                                                "function": {"name": name, "arguments": args}}])  # fmt: skip

    assert message_key(with_args('{"a": 1, "b": [1, 2]}')) == message_key(with_args('{"b":[1,2],"a":1}'))
    assert message_key(with_args('{"a": 1}')) == message_key(with_args({"a": 1}))
    assert message_key(with_args('{"a": 1}')) != message_key(with_args('{"a": true}'))
    assert message_key(with_args('{"a": 1}')) != message_key(with_args('{"a": 1}', call_id="c2"))
    assert message_key(with_args('{"a": 1}')) != message_key(with_args('{"a": 1}', name="g"))


def test_reasoning_is_one_key_and_absence_matches() -> None:
    assert M(role="assistant", content="x", reasoning="r").reasoning_text() == "r"
    assert M(role="assistant", content="x", reasoning_content="r").reasoning_text() == "r"
    assert reasoning_matches("r", None) and reasoning_matches(None, "r") and reasoning_matches("r", "r")
    assert not reasoning_matches("r", "s")
    assert not reasoning_matches("\n\n", "\n")


def test_reasoning_matches_without_the_whitespace_around_it() -> None:
    """Qwen Code echoes Qwen3's "\nthought\n" trimmed; the Redis store's digests compare the same way."""
    assert reasoning_matches("\nthought\n", "thought") and reasoning_matches("thought", " thought\n")
    assert not reasoning_matches("\nthought\n", "thought two") and not reasoning_matches("a b", "ab")
    assert reasoning_digest("\nthought\n") == reasoning_digest("thought") != reasoning_digest("thought two")
    assert reasoning_digest("\n\n") != reasoning_digest("\n") and reasoning_digest(None) == reasoning_digest("") == ""


def commit(store, session, parent, messages_before, appended, assistant, ids=(1, 2), completion=(3,)):
    segment = appended + [assistant]
    turn = Turn(len(messages_before) + len(segment), tuple(keys(segment)), reasonings(segment)[-1], ids, completion,
                "stop")  # fmt: skip
    return store.commit(session, parent, turn)


SYSTEM = M(role="system", content="sys")
USER = M(role="user", content="hi")
A1 = M(role="assistant", content="hello", reasoning_content="think 1")
TOOL = M(role="tool", content="result", tool_call_id="c1")
A2 = M(role="assistant", content="done", reasoning_content="think 2")


def test_deepest_attachment_and_branches() -> None:
    store = MemoryTree()
    session = store.new_session("s1")
    t0 = commit(store, session, None, [], [SYSTEM, USER], A1)
    t1 = commit(store, session, t0, [SYSTEM, USER, A1], [TOOL], A2, ids=(4,), completion=(5, 6))
    # A request extending turn 1 attaches there, even with reasoning dropped on echo.
    echoed = [SYSTEM, USER, M(role="assistant", content="hello"), TOOL, M(role="assistant", content="done"),
              M(role="user", content="more")]  # fmt: skip
    found = store.locate("s1", keys(echoed), reasonings(echoed))
    assert found.parent is t1 and found.matched == 5
    # A different tool result branches at turn 0.
    edited = [SYSTEM, USER, A1, M(role="tool", content="other", tool_call_id="c1")]
    found = store.locate("s1", keys(edited), reasonings(edited))
    assert found.parent is t0 and found.matched == 3
    # Different present reasoning is a different history.
    wrong = [SYSTEM, USER, M(role="assistant", content="hello", reasoning_content="other"), TOOL]
    assert store.locate("s1", keys(wrong), reasonings(wrong)).parent is None
    # Retrying the first request is a first turn again (a new root), not an error.
    retry = [SYSTEM, USER]
    assert store.locate("s1", keys(retry), reasonings(retry)).parent is None
    assert t1.full_ids() == [1, 2, 3, 4, 5, 6]
    assert t1.prompt_len == 4


def test_few_shot_assistants_in_the_first_request_do_not_confuse_attachment() -> None:
    """Reference bug: checkpoints counted by role=assistant; here each turn knows its own message end."""
    store = MemoryTree()
    session = store.new_session("s")
    shot_q, shot_a = M(role="user", content="2+2?"), M(role="assistant", content="4")
    first = [SYSTEM, shot_q, shot_a, USER]
    t0 = commit(store, session, None, [], first, A1)
    retry_tool = first + [A1, M(role="tool", content="v2", tool_call_id="c1")]
    found = store.locate("s", keys(retry_tool), reasonings(retry_tool))
    assert found.parent is t0 and found.matched == 5


def test_automatic_sessions_are_found_by_their_messages() -> None:
    store = MemoryTree()
    s1, s2 = store.new_session(None), store.new_session(None)
    assert s1.automatic and s1.session_id != s2.session_id
    u1, u2 = M(role="user", content="task one"), M(role="user", content="task two")
    t1 = commit(store, s1, None, [], [u1], A1)
    t2 = commit(store, s2, None, [], [u2], A1)
    follow = [u2, A1, M(role="user", content="next")]
    found = store.locate(None, keys(follow), reasonings(follow))
    assert found.session is s2 and found.parent is t2
    # The same first request again (another sample of a GRPO group, or a retry) joins s1 as a new root.
    again = store.locate(None, keys([u1]), reasonings([u1]))
    assert again.session is s1 and again.parent is None
    assert store.locate(None, keys([M(role="user", content="task three")]), [None]).session is None
    assert t1.session is s1


def test_identical_siblings_are_resolved_deterministically_and_flagged() -> None:
    store = MemoryTree()
    session = store.new_session("s")
    a = commit(store, session, None, [], [USER], A1, completion=(7,))
    b = commit(store, session, None, [], [USER], A1, completion=(8,))
    follow = [USER, A1, M(role="user", content="x")]
    found = store.locate("s", keys(follow), reasonings(follow))
    assert found.parent is a and found.ambiguous
    assert b.turn_id == 1


def test_sweep_closes_idle_then_least_recently_used_but_never_in_flight() -> None:
    store = MemoryTree(idle_timeout=100, max_sessions=2)
    sessions = [store.new_session(f"s{i}") for i in range(4)]
    for i, session in enumerate(sessions):
        commit(store, session, None, [], [M(role="user", content=f"q{i}")], A1)
    now = sessions[-1].last_used
    sessions[0].last_used = now - 500  # idle
    sessions[1].inflight = 1  # busy: never evicted
    closed = store.sweep(now)
    assert [(s.session_id, why) for s, why in closed] == [("s0", "idle"), ("s2", "evicted")]
    assert list(store.sessions) == ["s1", "s3"]
    sessions[1].inflight = 0
    store.touch(sessions[1])
    assert list(store.sessions) == ["s3", "s1"]


def test_evicted_automatic_sessions_leave_the_indexes() -> None:
    store = MemoryTree(max_sessions=1)
    first, second = store.new_session(None), store.new_session(None)
    u1, u2 = M(role="user", content="one"), M(role="user", content="two")
    commit(store, first, None, [], [u1], A1)
    commit(store, second, None, [], [u2], A1)
    assert [s for s, _ in store.sweep()] == [first]
    assert store.locate(None, keys([u1, A1]), reasonings([u1, A1])).session is None
    assert store.locate(None, keys([u1]), [None]).session is None
    assert store.locate(None, keys([u2, A1]), reasonings([u2, A1])).session is second


def test_a_thousand_turn_history_is_located_without_recursion_limits() -> None:
    store = MemoryTree()
    session = store.new_session("long")
    history: list[ChatMessage] = []
    parent = None
    for i in range(1500):
        appended = [M(role="user", content=f"u{i}")]
        reply = M(role="assistant", content=f"a{i}")
        parent = commit(store, session, parent, history, appended, reply, ids=(i,), completion=(i,))
        history += appended + [reply]
    found = store.locate("long", keys(history), reasonings(history))
    assert found.parent is parent and found.matched == 3000


def test_lookup_cost_does_not_grow_with_the_number_of_sessions(monkeypatch) -> None:
    """Count candidate turns examined per lookup (not time): the same for 10 and for 2,000 live sessions."""
    from tito_addon.sessions.session_tree import TurnNode

    examined = []
    real = TurnNode.reasoning_compatible
    monkeypatch.setattr(TurnNode, "reasoning_compatible", lambda self, r, s: examined.append(self) or real(self, r, s))
    costs = []
    for count in (10, 2000):
        store = MemoryTree()
        last = None
        for i in range(count):
            session = store.new_session(None)
            u = M(role="user", content=f"task {i}")
            root = commit(store, session, None, [], [u], A1)
            last = commit(store, session, root, [u, A1], [TOOL], A2)
        examined.clear()
        probe = [M(role="user", content=f"task {count - 1}"), A1, TOOL, A2, M(role="user", content="go on")]
        found = store.locate(None, keys(probe), reasonings(probe))
        assert found.parent is last
        costs.append(len(examined))
    assert costs[0] == costs[1] == 2
