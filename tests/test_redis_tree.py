"""The Redis session tree against a real redis-server on loopback: concurrent claims never share a turn id, a GRPO
group's identical first requests join one automatic session, commits are found by their path digests in one round
trip, turns round-trip exactly and are served from cache once read, and a store that is gone is a clear error."""

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

from tito_addon.sessions.path_keys import ROOT, extend
from tito_addon.sessions.redis_tree import RedisTree, StoreUnavailable

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


def test_concurrent_claims_on_one_session_never_share_a_turn_id(redis_url) -> None:
    prefix = uuid.uuid4().hex

    async def scenario() -> list[int]:
        proxies = [tree(redis_url, prefix) for _ in range(4)]  # four clients: four "proxies"
        claims = [p.claim("team/run-1", "ns", b"", "unused") for p in proxies for _ in range(32)]
        return [turn for _, turn in await asyncio.gather(*claims)]

    assert sorted(run(scenario())) == list(range(128))


def test_identical_first_requests_join_one_automatic_session(redis_url) -> None:
    prefix = uuid.uuid4().hex
    prompt = extend(ROOT, [os.urandom(16)])

    async def scenario() -> list[tuple[str, int]]:
        proxies = [tree(redis_url, prefix) for _ in range(4)]
        claims = [p.claim(None, "ns", prompt, uuid.uuid4().hex) for p in proxies for _ in range(4)]
        other = await proxies[0].claim(None, "other-model", prompt, uuid.uuid4().hex)
        return [*await asyncio.gather(*claims), other]

    claimed = run(scenario())
    group, other = claimed[:-1], claimed[-1]
    assert len({sid for sid, _ in group}) == 1, "one session per GRPO group"
    assert sorted(turn for _, turn in group) == list(range(16)), "each sample its own turn"
    assert other[0] != group[0][0], "the same prompt to another model is another experiment"


def test_committed_turns_are_found_by_path_and_read_back_exactly(redis_url) -> None:
    prefix = uuid.uuid4().hex
    keys = [os.urandom(16) for _ in range(4)]
    first_path, second_path = extend(ROOT, keys[:2]), extend(ROOT, keys)
    big = [0, 1, 151645, 2**32 - 1]

    async def scenario():
        writer, reader = tree(redis_url, prefix), tree(redis_url, prefix)
        sid, turn0 = await writer.claim(None, "ns", first_path, uuid.uuid4().hex)
        await writer.commit(sid, turn0, automatic=True, namespace="ns", parent_turn_id=None, message_end=2,
                            segment_keys=tuple(keys[:2]), reasoning="think", added_ids=big, completion_ids=[7, 8],
                            finish_reason="tool_calls", path=first_path, reply_id="resp_a")  # fmt: skip
        for _ in range(2):  # a retry: two siblings on the same path
            _, turn = await writer.claim(sid, "ns", b"", "unused")
            await writer.commit(sid, turn, automatic=True, namespace="ns", parent_turn_id=turn0, message_end=4,
                                segment_keys=tuple(keys[2:]), reasoning=None, added_ids=[9], completion_ids=[10],
                                finish_reason="stop", path=second_path, template_kwargs={"x": 1})  # fmt: skip
        found = await reader.lookup(None, "ns", [first_path, second_path, extend(ROOT, keys[:3])])
        node = await reader.node(sid, turn0)
        calls = []
        original = reader.client.hgetall
        reader.client.hgetall = lambda *a, **k: calls.append(a) or original(*a, **k)
        again = await reader.node(sid, turn0)
        calls_for_node = list(calls)
        return sid, found, node, again, calls_for_node, await reader.by_reply("resp_a"), await reader.meta(sid)

    sid, found, node, again, calls, reply, meta = run(scenario())
    assert found == [[(sid, 0)], [(sid, 1), (sid, 2)], []]
    assert list(node.added_ids) == big and list(node.completion_ids) == [7, 8]
    assert node.segment_keys == tuple(keys[:2]) and node.message_end == 2 and node.parent_turn_id is None
    assert node.reasoning is not None and node.finish_reason == "tool_calls" and node.reply_id == "resp_a"
    assert again is node and calls == [], "a committed turn is read once"
    assert reply == (sid, 0)
    assert meta["turns"] == "3" and meta["tokens"] == str(4 + 2 + 2 + 2) and meta["automatic"] == "1"


def test_a_store_that_is_gone_is_a_clear_error() -> None:
    gone = tree(f"redis://127.0.0.1:{free_port()}/0", "x")
    with pytest.raises(StoreUnavailable, match="session store failed"):
        run(gone.claim("s", "ns", b"", "unused"))
