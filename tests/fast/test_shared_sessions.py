"""Two real mitmdumps on one real redis-server (`tito_session_store`): any proxy serves any turn of any session.

An openai-SDK agent alternates between the proxies turn by turn; every follow-up must extend exactly the ids of the
turn before it (what the replica received and generated), whichever proxy served either. Also: streamed turns,
Responses' `previous_response_id` across proxies, Redis going away (503 naming the store, nothing forwarded or
recorded, then the sessions continue), idle sessions closed once and resumed from every writer's record part, and a
restarted proxy that rebuilds nothing from files."""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import openai
import pytest
from support.basics import TOOLS, echo, tokenizer_path
from support.proxy_harness import post

from tito_addon.proxy.tito_settings import TitoSettings
from tito_addon.records.record_reader import read_session
from tito_addon.replicas.proxy_process import Mitmdump
from tito_addon.sessions.session_tree import sweep_interval

KEY = "sk-tito-conc-KEY-3b02"


@pytest.fixture(scope="module")
def redis(redis_server):
    return redis_server


def start(replica, redis, record_dir: Path, cwd: Path, **options: str) -> Mitmdump:
    cwd.mkdir(parents=True, exist_ok=True)
    settings = {"tito_session_store": redis.url, "tito_upstream_timeout": "20", **options}
    return Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=cwd,
                    options=settings).start()  # fmt: skip


@pytest.fixture(scope="module")
def proxy_pair(replica, redis, tmp_path_factory):
    """Two proxies on one Redis, recording to one dir (each its own part of a session's file), started once for
    the module: each test works in sessions of its own (a fresh uuid), so it needs fresh sessions, not processes."""
    root = tmp_path_factory.mktemp("pair")
    record_dir = root / "rec"
    proxies = [start(replica, redis, record_dir, root / f"p{i}") for i in range(2)]
    try:
        yield proxies, record_dir
    finally:
        for proxy in proxies:  # a test may have replaced one (a restart): the list holds the live ones
            proxy.stop()


@pytest.fixture
def pair(proxy_pair, replica):
    """The module's two proxies, with the backend's call log emptied for this test."""
    replica.backend.reset()
    return proxy_pair


def client(proxy: Mitmdump, session: str | None = None) -> openai.OpenAI:
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=KEY, default_headers=headers, max_retries=0)


def follow_up(messages: list[dict], message, turn: int) -> None:
    messages.append(echo(message))
    if message.tool_calls:
        for index, call in enumerate(message.tool_calls):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}.{index}"})
    else:
        messages.append({"role": "user", "content": f"And round {turn}?"})


def alternate(proxies, turns: int, *, session: str | None = None, stream_on: int | None = None, first="Hi", model="m"):
    """One agent, turn t on proxy t % 2; returns the raw responses' (session id, turn id) and the messages."""
    messages: list[dict] = [{"role": "user", "content": first}]
    served = []
    for turn in range(turns):
        api = client(proxies[turn % 2], session)
        if stream_on is not None and turn % 2 == stream_on:
            with api.chat.completions.stream(model=model, messages=messages, tools=TOOLS) as events:
                for _ in events:
                    pass
                completion = events.get_final_completion()
            served.append(None)
        else:
            raw = api.chat.completions.with_raw_response.create(model=model, messages=messages, tools=TOOLS)
            completion = raw.parse()
            served.append((raw.headers["x-tito-session-id"], int(raw.headers["x-tito-turn-id"])))
        follow_up(messages, completion.choices[0].message, turn)
    return served, messages


def assert_chain_exact(replica, record_dir: Path, session_id: str, turns: int) -> None:
    """Every turn extends the one before it, id for id, as the replica received and generated them."""
    received, generated = replica.received(), replica.generated()
    assert len(received) == len(generated) == turns
    recorded = read_session(record_dir, session_id)
    assert recorded is not None and len(recorded.turns) == turns
    assert len(recorded.paths) == 2, "each proxy wrote its own part of the session"
    ids = recorded.full_ids()
    previous: list[int] = []
    for index, record in enumerate(recorded.turns):
        prompt, completion = ids[record.turn_id]
        assert received[index]["input_ids"] == prompt, f"turn {index}: the backend got other ids than recorded"
        assert generated[index]["completion_ids"] == completion
        assert prompt[: len(previous)] == previous, f"turn {index} does not extend the turn before it"
        assert record.parent_turn_id == (recorded.turns[index - 1].turn_id if index else None)
        previous = prompt + completion


def test_an_automatic_session_continues_on_whichever_proxy_gets_the_turn(pair, replica) -> None:
    proxies, record_dir = pair
    served, _ = alternate(proxies, 6, first=f"Plan a trip {uuid.uuid4().hex}")
    assert len({sid for sid, _ in served}) == 1, "one session, whichever proxy served the turn"
    assert [turn for _, turn in served] == list(range(6))
    assert_chain_exact(replica, record_dir, served[0][0], 6)


def test_a_named_session_and_streamed_turns_continue_across_proxies(pair, replica) -> None:
    proxies, record_dir = pair
    sid = f"named-{uuid.uuid4().hex[:8]}"
    served, _ = alternate(proxies, 6, session=sid, stream_on=1)
    assert {s for s, _ in filter(None, served)} == {sid}
    assert_chain_exact(replica, record_dir, sid, 6)
    streamed = [body for body in replica.received() if body.get("stream")]
    assert len(streamed) == 3, "the streamed turns took the live path"


def test_previous_response_id_continues_on_the_other_proxy(pair, replica) -> None:
    proxies, record_dir = pair
    first = openai.OpenAI(base_url=proxies[0].url + "/v1", api_key=KEY, max_retries=0)
    second = openai.OpenAI(base_url=proxies[1].url + "/v1", api_key=KEY, max_retries=0)
    one = first.responses.create(model="m", input=f"Say hi {uuid.uuid4().hex}")
    two = second.responses.create(model="m", input="Again?", previous_response_id=one.id)
    received, generated = replica.received(), replica.generated()
    assert received[1]["input_ids"][: len(received[0]["input_ids"])] == received[0]["input_ids"]
    assert (
        received[1]["input_ids"][len(received[0]["input_ids"]) :][: len(generated[0]["completion_ids"])]
        == (generated[0]["completion_ids"])
    )
    assert two.id != one.id


def test_redis_going_away_is_a_503_that_changes_nothing_then_sessions_continue(pair, replica, redis) -> None:
    proxies, record_dir = pair
    sid = f"outage-{uuid.uuid4().hex[:8]}"
    _, messages = alternate(proxies, 2, session=sid)
    before = (len(replica.received()), sorted((p.name, p.read_bytes()) for p in record_dir.glob("*.jsonl")))
    redis.stop()
    try:
        for proxy in proxies:
            reply = post(proxy.url + "/v1/chat/completions", headers={"x-session-id": sid}, timeout=30,
                               json={"model": "m", "messages": messages, "tools": TOOLS})  # fmt: skip
            assert reply.status_code == 503, reply.text
            error = reply.json()["error"]
            assert "session store" in error["message"] and "Redis" in error["message"]
            auto = post(proxy.url + "/v1/chat/completions", timeout=30,
                              json={"model": "m", "messages": [{"role": "user", "content": "new"}]})  # fmt: skip
            assert auto.status_code == 503, auto.text
    finally:
        redis.start()
    after = (len(replica.received()), sorted((p.name, p.read_bytes()) for p in record_dir.glob("*.jsonl")))
    assert after == before, "nothing forwarded, nothing recorded while the store was gone"
    raw = client(proxies[1], sid).chat.completions.with_raw_response.create(model="m", messages=messages, tools=TOOLS)
    assert raw.status_code == 200 and raw.headers["x-tito-turn-id"] == "2", "the session continues where it was"
    recorded = read_session(record_dir, sid)
    assert recorded is not None and [t.parent_turn_id for t in recorded.turns] == [None, 0, 1]
    received = replica.received()
    assert received[-1]["input_ids"][: len(received[-2]["input_ids"])] == received[-2]["input_ids"]


def test_idle_sessions_close_once_and_resume_from_every_writers_part(replica, redis, tmp_path) -> None:
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    proxies = [start(replica, redis, record_dir, tmp_path / f"p{i}", tito_session_idle_timeout="1") for i in range(2)]
    try:
        sid = f"idle-{uuid.uuid4().hex[:8]}"
        _, messages = alternate(proxies, 3, session=sid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            recorded = read_session(record_dir, sid)
            if recorded is not None and recorded.closes:
                break
            time.sleep(0.5)
        time.sleep(8 * sweep_interval(1))  # eight more sweeps on each proxy: still one close line
        recorded = read_session(record_dir, sid)
        assert recorded is not None and [(c.reason, c.turns) for c in recorded.closes] == [("idle", 3)]
        raw = client(proxies[0], sid).chat.completions.with_raw_response.create(
            model="m", messages=messages, tools=TOOLS
        )
        assert raw.headers["x-tito-turn-id"] == "3", "turn ids continue after the resumed ones"
        received, generated = replica.received(), replica.generated()
        assert received[3]["input_ids"][: len(received[2]["input_ids"])] == received[2]["input_ids"]
        tail = received[3]["input_ids"][len(received[2]["input_ids"]) :]
        assert tail[: len(generated[2]["completion_ids"])] == generated[2]["completion_ids"], (
            "the resumed session continues the last turn's exact ids, written by the other proxy"
        )
        assert any("resumed session" in line for p in proxies for line in p.lines)
    finally:
        for proxy in proxies:
            proxy.stop()


def test_a_restarted_proxy_rebuilds_nothing_from_files(pair, replica, redis, tmp_path) -> None:
    proxies, record_dir = pair
    sid = f"restart-{uuid.uuid4().hex[:8]}"
    _, messages = alternate(proxies, 2, session=sid)
    proxies[0].kill()
    proxies[0] = start(replica, redis, record_dir, tmp_path / "p0-again")
    raw = client(proxies[0], sid).chat.completions.with_raw_response.create(model="m", messages=messages, tools=TOOLS)
    assert raw.headers["x-tito-turn-id"] == "2"
    assert not any("resumed session" in line for line in proxies[0].lines), "Redis had it: no file was read"
    recorded = read_session(record_dir, sid)
    assert recorded is not None and [t.parent_turn_id for t in recorded.turns] == [None, 0, 1]
    # A record file, not the signing key the Responses turns of this module left beside them (listing order varies).
    first = sorted(record_dir.glob("*.jsonl"))[0]
    assert json.loads(first.read_text().splitlines()[0])["session_id"]


def test_the_readmes_deployment_recipe_is_valid(tmp_path) -> None:
    """The README's one-node recipe: HAProxy accepts its config as written, and every option it sets is the addon's."""
    import re
    import subprocess

    from support.basics import REPO

    readme = (REPO / "README.md").read_text("utf-8")
    recipe = readme[readme.index("### Many proxies, one session space") :]
    config = re.search(r"cat > haproxy.cfg <<'CFG'\n(.*?)\nCFG\n", recipe, re.S)
    assert config is not None, "the recipe's HAProxy config is not where the test looks"
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        if os.environ.get("TITO_HAPROXY_REQUIRED") == "1":
            pytest.fail("haproxy is required here (CI installs Debian's haproxy)")
        pytest.skip("haproxy is not installed")
    (tmp_path / "haproxy.cfg").write_text(config.group(1) + "\n")
    check = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "balance roundrobin" in config.group(1) and "cookie" not in config.group(1), "no stickiness"
    options = set(re.findall(r"--set (tito_\w+)=", recipe.split("```")[1]))
    known = TitoSettings.option_names()
    assert options and options <= known, options - known


def test_vllm_turns_continue_across_proxies(redis, tmp_path) -> None:
    """The same on a vLLM-shaped backend (render -> generate -> derender), a streamed turn included."""
    from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

    with VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), version="0.32.0")) as vllm:
        record_dir = tmp_path / "rec"
        proxies = [start(vllm, redis, record_dir, tmp_path / f"v{i}", tito_backend_kind="vllm") for i in range(2)]
        try:
            sid = f"vllm-{uuid.uuid4().hex[:8]}"
            served, _ = alternate(proxies, 4, session=sid, stream_on=1, model="tiny-qwen3")
        finally:
            for proxy in proxies:
                proxy.stop()
        generated = vllm.generated()
    assert {s for s, _ in filter(None, served)} == {sid} and len(generated) == 4
    recorded = read_session(record_dir, sid)
    assert recorded is not None and len(recorded.paths) == 2
    ids = recorded.full_ids()
    previous: list[int] = []
    for index, record in enumerate(recorded.turns):
        prompt, completion = ids[record.turn_id]
        assert generated[index]["prompt_ids"] == prompt and generated[index]["completion_ids"] == completion
        assert prompt[: len(previous)] == previous, f"turn {index} does not extend the turn before it"
        previous = prompt + completion


def test_a_driver_closes_a_shared_session_for_every_proxy(replica, redis, tmp_path) -> None:
    """The control API on either proxy sees the shared session; a close on one is a final 410 for the name on both."""
    from tito_addon.client import TitoClient

    token = "control-token-shared-0123456789"
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    proxies = [start(replica, redis, record_dir, tmp_path / f"p{i}", tito_control_token=token) for i in range(2)]
    try:
        alternate(proxies, 2, session="ep-shared")
        with TitoClient(proxies[0].url, token) as first, TitoClient(proxies[1].url, token) as second:
            live = {row["session_id"]: row for row in first.sessions(live=True)}
            assert live["ep-shared"]["live"] is True
            assert second.session("ep-shared")["turns"] == 2 and second.wait_idle("ep-shared") is True
            second.annotate("ep-shared", reward=1.0)
            assert [row["reward"] for row in first.rows("ep-shared")] == [1.0]
            assert second.close("ep-shared") == {
                "session_id": "ep-shared", "closed": True, "turns": 2, "already_closed": False
            }  # fmt: skip
            assert first.session("ep-shared")["live"] is False
            before = {p.name: p.read_bytes() for p in record_dir.glob("*.jsonl")}
            for proxy in proxies:
                with pytest.raises(openai.APIStatusError, match="closed by its driver") as gone:
                    alternate([proxy], 1, session="ep-shared")
                assert gone.value.status_code == 410 and gone.value.response.headers["x-should-retry"] == "false"
            assert {p.name: p.read_bytes() for p in record_dir.glob("*.jsonl")} == before
            assert len(replica.received()) == 2, "nothing was forwarded for the closed name"
            assert first.close("ep-shared")["already_closed"] is True
    finally:
        for proxy in proxies:
            proxy.stop()
    recorded = read_session(record_dir, "ep-shared")
    assert recorded is not None and [c.reason for c in recorded.closes] == ["closed"]
