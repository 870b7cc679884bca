"""The Redis session tree against a real redis-server on loopback: concurrent claims never share a turn id, a GRPO
group's identical first requests join one automatic session, commits are found by their path digests in one round
trip, turns round-trip exactly and are served from a proxy's cache once read, a session closes once (never while a
turn is in flight) and its turn ids are never reused, and a store that is gone is a clear error."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tito_addon.chat_images import ImageSpan
from tito_addon.sessions.path_keys import ROOT, extend
from tito_addon.sessions.redis_sessions import RedisSessions
from tito_addon.sessions.redis_tree import RedisTree, StoredTurn
from tito_addon.sessions.session_ids import automatic_session_id
from tito_addon.sessions.turn_entity import Turn
from tito_addon.tito_errors import SessionGone, StoreUnavailable

redis_asyncio = pytest.importorskip("redis.asyncio")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = shutil.which("redis-server")
    if server is None:
        if os.environ.get("TITO_REDIS_REQUIRED") == "1":
            pytest.fail("redis-server is required here (CI installs Debian's redis-server)")
        pytest.skip("redis-server is not installed")
    port = free_port()
    workdir: Path = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=10)


def tree(url: str, prefix: str) -> RedisTree:
    return RedisTree(redis_asyncio.Redis.from_url(url), prefix=prefix)


def run(coroutine):
    return asyncio.run(coroutine)


def now() -> int:
    return int(time.time() * 1000)


async def claim(t: RedisTree, sid, ns="ns", prompt=b"", fresh="unused", **kw) -> tuple[str, int]:
    return await t.claim(sid, ns, prompt, fresh, now_ms=now(), busy_until_ms=now() + 60_000, **kw)


async def commit(t: RedisTree, sid: str, turn: int, *, automatic: bool, keys, path: bytes, parent=None, chain=(), end=2,
                 **kw) -> None:  # fmt: skip
    fields = dict(reasoning=None, prompt_added_ids=[1], completion_ids=[2], finish_reason="stop")
    fields.update(kw)
    stored = StoredTurn(sid, turn, parent, chain, Turn(message_end=end, segment_keys=tuple(keys), **fields))
    await t.commit(stored, automatic=automatic, namespace="ns", path=path, now_ms=now())


def test_concurrent_claims_on_one_session_never_share_a_turn_id(redis_url) -> None:
    prefix = uuid.uuid4().hex

    async def scenario() -> list[int]:
        proxies = [tree(redis_url, prefix) for _ in range(4)]  # four clients: four "proxies"
        claims = [claim(p, "team/run-1") for p in proxies for _ in range(32)]
        return [turn for _, turn in await asyncio.gather(*claims)]

    assert sorted(run(scenario())) == list(range(128))


def test_identical_first_requests_join_one_automatic_session(redis_url) -> None:
    prefix = uuid.uuid4().hex
    prompt = extend(ROOT, [os.urandom(16)])

    async def scenario() -> list[tuple[str, int]]:
        proxies = [tree(redis_url, prefix) for _ in range(4)]
        claims = [claim(p, None, prompt=prompt, fresh=automatic_session_id()) for p in proxies for _ in range(4)]
        other = await claim(proxies[0], None, ns="other-model", prompt=prompt, fresh=automatic_session_id())
        return [*await asyncio.gather(*claims), other]

    claimed = run(scenario())
    group, other = claimed[:-1], claimed[-1]
    assert len({sid for sid, _ in group}) == 1, "one session per GRPO group"
    assert sorted(turn for _, turn in group) == list(range(16)), "each sample its own turn"
    assert other[0] != group[0][0], "the same prompt to another model is another experiment"


IMAGE = ImageSpan(sha256="ab" * 32, format="png", width=640, height=480, offset=3, length=391)


def test_committed_turns_are_found_by_path_and_read_back_exactly(redis_url) -> None:
    prefix = uuid.uuid4().hex
    keys = [os.urandom(16) for _ in range(4)]
    first_path, second_path = extend(ROOT, keys[:2]), extend(ROOT, keys)
    big = [0, 1, 151645, 2**32 - 1]

    async def scenario():
        writer, reader = tree(redis_url, prefix), tree(redis_url, prefix)
        sid, turn0 = await claim(writer, None, prompt=extend(ROOT, keys[:1]), fresh=automatic_session_id())
        await commit(writer, sid, turn0, automatic=True, keys=keys[:2], path=first_path, reasoning="ab" * 16,
                                     prompt_added_ids=big, completion_ids=[7, 8], finish_reason="tool_calls",
                                     reply_id="resp_a")  # fmt: skip
        for _ in range(2):  # a retry: two siblings on the same path
            _, turn = await claim(writer, sid, parent_turn_id=turn0, create=False)
            await commit(writer, sid, turn, automatic=True, keys=keys[2:], path=second_path, parent=turn0,
                                         chain=(turn0,), end=4, prompt_added_ids=[9], completion_ids=[10],
                                         chat_template_kwargs={"x": 1}, routed_experts_through=5,
                                         images=(IMAGE,))  # fmt: skip
        state, found = await reader.lookup(None, "ns", [first_path, second_path, extend(ROOT, keys[:3])])
        node = await reader.node(sid, 2)
        shared = RedisSessions(reader)
        calls = []
        original = reader.client.pipeline
        reader.client.pipeline = lambda *a, **k: calls.append(a) or original(*a, **k)
        first = await shared.hydrate([(sid, 2)], True, "ns")
        again = await shared.hydrate([(sid, 2)], True, "ns")
        return (
            sid,
            state,
            found,
            node,
            first,
            again,
            len(calls),
            await reader.by_reply("resp_a"),
            await reader.meta(sid),
        )

    sid, state, found, node, first, again, calls, reply, meta = run(scenario())
    assert state is None
    assert found == [[(sid, 0)], [(sid, 1), (sid, 2)], []]
    assert list(node.turn.prompt_added_ids) == [9] and node.parent_turn_id == 0 and node.chain == (0,)
    assert node.turn.chat_template_kwargs == {"x": 1} and node.turn.message_end == 4
    assert node.turn.routed_experts_through == 5  # (a child asks for its MoE routes from there)
    assert node.turn.images == (IMAGE,)  # (the images its prompt added, and where their pads lie)
    assert node.turn.segment_keys == tuple(keys[2:])
    mirror = first[(sid, 2)]
    assert mirror.parent is not None and list(mirror.parent.turn.prompt_added_ids) == big, (
        "ancestors come with the turn"
    )
    assert mirror.full_ids() == [*big, 7, 8, 9, 10] and mirror.path == second_path
    assert mirror.parent.turn.reasoning == "ab" * 16 and mirror.parent.turn.finish_reason == "tool_calls"
    assert again[(sid, 2)] is mirror and calls == 2, "a turn and its ancestors: two round trips, then none"
    assert reply == (sid, 0)
    assert meta["turns"] == "3" and meta["tokens"] == str(4 + 2 + 2 + 2) and meta["automatic"] == "1"


def test_a_session_closes_once_never_while_busy_and_never_reuses_a_turn_id(redis_url) -> None:
    prefix = uuid.uuid4().hex
    keys = [os.urandom(16) for _ in range(2)]
    path = extend(ROOT, keys)

    async def scenario():
        a, b = tree(redis_url, prefix), tree(redis_url, prefix)
        sid, t0 = await claim(a, "named")
        await commit(a, sid, t0, automatic=False, keys=keys, path=path, reply_id="resp_n")
        _, busy = await claim(a, "named", parent_turn_id=t0)  # in flight: not closable
        refused = await b.close("named", now_ms=now(), idle_before_ms=None)
        await commit(a, sid, busy, automatic=False, keys=keys, path=extend(path, keys), parent=t0,
                                chain=(t0,), end=4)  # fmt: skip
        closes = await asyncio.gather(*(p.close("named", now_ms=now(), idle_before_ms=None) for p in (a, b, a, b)))
        after_close = await b.lookup("named", "", [path]), await b.by_reply("resp_n"), await b.node(sid, t0)
        with pytest.raises(SessionGone):
            await claim(b, "named", create=False)
        _, reopened = await claim(b, "named")
        # A claim whose proxy died: in flight until its deadline, then abandoned (here: already past).
        auto_sid, _ = await a.claim(
            None, "ns", b"p" * 16, automatic_session_id(), now_ms=now(), busy_until_ms=now() - 1
        )
        assert await a.close(auto_sid, now_ms=now(), idle_before_ms=None) == 0
        with pytest.raises(SessionGone):
            await claim(b, auto_sid, create=False)
        return refused, closes, after_close, reopened

    refused, closes, (lookup, reply, node), reopened = run(scenario())
    assert refused is None, "a session with a turn in flight stays open"
    assert sorted(closes, key=str) == [2, None, None, None], "one proxy closes it (and writes its close line)"
    assert lookup == ("1", [[]]) and reply is None and node is None, "its turns and indexes are gone"
    assert reopened == 2, "a resumed session continues its turn ids"


def test_a_closed_named_session_is_restored_once(redis_url) -> None:
    prefix = uuid.uuid4().hex
    keys = [os.urandom(16) for _ in range(4)]

    async def scenario():
        a, b = tree(redis_url, prefix), tree(redis_url, prefix)
        nodes = [
            make_stored("r", 0, None, keys[:2], (), [1, 2], [3]),
            make_stored("r", 3, 0, keys[2:], (0,), [4], [5, 6]),
        ]
        paths = [extend(ROOT, keys[:2]), extend(ROOT, keys)]
        done = await asyncio.gather(*(p.restore("r", nodes, paths, now_ms=now(), next_at_least=5) for p in (a, b)))
        state, found = await a.lookup("r", "", paths)
        _, turn = await claim(b, "r", parent_turn_id=3)
        return done, state, found, turn, await a.node("r", 3), await a.meta("r")

    done, state, found, turn, node, meta = run(scenario())
    assert sorted(done) == [False, True], "restored by one proxy"
    assert state == "0" and found == [[("r", 0)], [("r", 3)]]
    assert turn == 5, "turn ids continue after the recorded ones (and torn lines)"
    assert list(node.turn.prompt_added_ids) == [4] and node.chain == (0,) and node.parent_turn_id == 0
    assert meta["turns"] == "2" and meta["tokens"] == "6"


def make_stored(sid, turn, parent, keys, chain, added, completion):
    return StoredTurn(
        sid, turn, parent, chain, Turn(2 * (len(chain) + 1), tuple(keys), None, added, completion, "stop")
    )


def test_a_store_that_is_gone_is_a_clear_error() -> None:
    gone = tree(f"redis://127.0.0.1:{free_port()}/0", "x")
    with pytest.raises(StoreUnavailable, match="session store") as raised:
        run(claim(gone, "s"))
    assert raised.value.status == 503


def test_the_proxys_client_serves_more_concurrent_turns_than_it_has_connections(redis_url) -> None:
    """Every turn in flight may await Redis at once: the proxy's client queues what its pool cannot hold (redis-py's
    default pool fails its 101st concurrent command with MaxConnectionsError, which was a 503 at 256 agents)."""
    from tito_addon.sessions.redis_tree import MAX_CONNECTIONS

    async def scenario() -> list:
        store = RedisSessions.connect(redis_url)
        try:
            paths = [os.urandom(16) for _ in range(8)]
            return await asyncio.gather(*(store.tree.lookup(None, "ns", paths) for _ in range(400)))
        finally:
            await store.aclose()

    found = run(scenario())
    assert len(found) == 400 > 4 * MAX_CONNECTIONS and all(state is None for state, _ in found)


def test_closing_an_automatic_session_removes_only_its_own_index_entries(redis_url) -> None:
    """Two automatic sessions whose turns end at the same path digest (one index entry each under one field):
    closing one leaves the other findable, and frees its GRPO group and reply ids."""
    prefix = uuid.uuid4().hex
    keys = [os.urandom(16) for _ in range(2)]
    path = extend(ROOT, keys)

    async def scenario():
        t = tree(redis_url, prefix)
        sids = []
        for group in (b"g" * 16, b"h" * 16):
            sid, turn = await claim(t, None, prompt=group, fresh=automatic_session_id())
            await commit(t, sid, turn, automatic=True, keys=keys, path=path, reply_id=f"resp_{sid}")  # fmt: skip
            sids.append(sid)
        before = await t.lookup(None, "ns", [path])
        closed = await t.close(sids[0], now_ms=now(), idle_before_ms=None)
        after = await t.lookup(None, "ns", [path])
        regroup, _ = await claim(t, None, prompt=b"g" * 16, fresh=automatic_session_id())
        return sids, before, closed, after, regroup, await t.by_reply(f"resp_{sids[0]}"), await t.node(sids[1], 0)

    sids, before, closed, after, regroup, reply, kept = run(scenario())
    assert before == (None, [[(sids[0], 0), (sids[1], 0)]]) and closed == 1
    assert after == (None, [[(sids[1], 0)]]), "only the closed session's entry went"
    assert regroup not in sids, "its GRPO group is free: the same first request starts a new session"
    assert reply is None and kept is not None and list(kept.turn.prompt_added_ids) == [1]


def test_a_driver_close_refuses_the_name_unless_new_trees_are_allowed(redis_url) -> None:
    from tito_addon.tito_errors import SessionClosed

    prefix = uuid.uuid4().hex
    keys = [os.urandom(16) for _ in range(2)]

    async def scenario():
        a, b = tree(redis_url, prefix), tree(redis_url, prefix)
        sid, t0 = await claim(a, "episode")
        _, busy = await claim(a, "episode", parent_turn_id=None)
        while_busy = await b.close_by_driver("episode", now_ms=now())
        in_flight = await b.in_flight("episode", now_ms=now())
        for turn in (t0, busy):
            path = extend(ROOT, keys + [turn.to_bytes(16, "little")])
            await commit(a, sid, turn, automatic=False, keys=[*keys[:1], path[:16]], path=path)
        closed = await b.close_by_driver("episode", now_ms=now())
        again = await a.close_by_driver("episode", now_ms=now())
        unknown = await a.close_by_driver("never-seen", now_ms=now())
        with pytest.raises(SessionClosed):
            await claim(b, "episode")
        _, reopened = await claim(b, "episode", reopen_closed=True)
        return while_busy, in_flight, closed, again, unknown, reopened

    while_busy, in_flight, closed, again, unknown, reopened = run(scenario())
    assert while_busy == ("busy", 0) and in_flight == 2
    assert closed == ("closed", 2) and again == ("already", 0) and unknown == ("unknown", 0)
    assert reopened == 2, "a new tree under the name continues its turn ids"
