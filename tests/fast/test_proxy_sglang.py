"""Integration: the openai SDK as the agent -> a real mitmdump with the addon -> the sglang replica.

Every test asserts token ids: what the replica received and generated, and what is on disk.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import openai
import pytest
from support.basics import TOOLS, echo, tokenizer_path
from support.chat_agent import SECRET, agent, run_agent
from support.proxy_harness import REPO, Mitmdump, get, post

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("recordings")


@pytest.fixture(scope="module")
def proxy(replica, record_dir, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("elsewhere")  # proves -s works from any directory
    with Mitmdump(
        replica.url,
        tokenizer=tokenizer_path("qwen3"),
        record_dir=record_dir,
        cwd=cwd,
        options={"tito_upstream_timeout": "3"},
    ) as running:
        yield running
        secret_free = SECRET not in running.output()
    assert secret_free, "an API key reached the mitmdump log"


@pytest.fixture
def fresh(replica):
    replica.backend.reset()
    return replica


def session_records(record_dir: Path, session_id: str):
    session_file = read_session_file(record_dir / session_file_name(session_id))
    return session_file, session_file.full_ids()


def test_twenty_turn_tool_session_is_token_exact(proxy, fresh, record_dir) -> None:
    sid = f"twenty-{uuid.uuid4().hex[:8]}"
    _, replies = run_agent(agent(proxy, sid), 20)
    assert any(r.choices[0].message.tool_calls for r in replies)
    assert any(r.choices[0].message.tool_calls and len(r.choices[0].message.tool_calls) == 2 for r in replies)
    received, generated = fresh.received(), fresh.generated()
    assert len(received) == len(generated) == 20
    session_file, ids = session_records(record_dir, sid)
    assert [t.turn_id for t in session_file.turns] == list(range(20))
    assert [t.parent_turn_id for t in session_file.turns] == [None, *range(19)]
    previous: list[int] = []
    for turn, record in enumerate(session_file.turns):
        prompt, completion = ids[turn]
        assert received[turn]["input_ids"] == prompt, f"turn {turn}: replica got other prompt ids than recorded"
        assert generated[turn]["completion_ids"] == completion
        assert generated[turn]["logprobs"] == record.completion_logprobs
        assert prompt[: len(previous)] == previous, f"turn {turn}: prompt does not extend the previous turn"
        previous = prompt + completion
        body = received[turn]
        assert body["logprobs"] is True and body["return_meta_info"] is True and body["stream"] is False
        assert "stream_options" not in body
        if turn:  # the echo proved this backend honours input_ids on its first turn (tests/fast/test_prompt_echo.py)
            assert "return_prompt_token_ids" not in body
        assert body["tools"] == TOOLS
        # sglang reads no message when given input_ids (backends/parser_inputs.py): the conversation stays here.
        assert body["messages"] == [{"role": "user", "content": ""}]
        if turn:  # a line holds only what the turn added, never the whole prompt again
            assert len(record.prompt_added_ids) < 80 < record.prompt_len
            assert record.tools is None
    sizes = [len(line) for line in (record_dir / session_file_name(sid)).read_text("utf-8").splitlines()]
    assert max(sizes[10:]) < 2 * max(sizes[1:10]), "record lines must not grow with the history"
    # The replica's non-canonical splits survive: the recorded ids are not a re-tokenization of the text.
    tok = fresh.backend.tokenizer.tok
    assert any(tok.encode(tok.decode(c), add_special_tokens=False) != c for _, c in ids.values())


def test_agent_response_is_an_ordinary_chat_completion(proxy, fresh) -> None:
    raw = agent(proxy, f"plain-{uuid.uuid4().hex[:6]}").chat.completions.with_raw_response.create(
        model="reference-model", messages=[{"role": "user", "content": "Hi"}]
    )
    body = json.loads(raw.content)
    choice = body["choices"][0]
    assert "meta_info" not in choice and "prompt_token_ids" not in choice and choice["logprobs"] is None
    assert choice["message"]["content"] and raw.headers["x-tito-turn-id"] == "0"
    # An agent that asks for logprobs gets them.
    asked = agent(proxy).chat.completions.create(
        model="reference-model", messages=[{"role": "user", "content": "Hi again"}], logprobs=True
    )
    assert asked.choices[0].logprobs is not None and asked.choices[0].logprobs.content


def test_streaming_accumulates_the_same_message_and_records_the_same_ids(proxy, fresh, record_dir) -> None:
    plain_sid, stream_sid = f"plain-{uuid.uuid4().hex[:6]}", f"stream-{uuid.uuid4().hex[:6]}"
    plain_messages, plain = run_agent(agent(proxy, plain_sid), 4)
    fresh.backend.reset()
    stream_messages, streamed = run_agent(agent(proxy, stream_sid), 4, stream=True)
    for a, b in zip(plain, streamed, strict=True):
        ma, mb = a.choices[0].message, b.choices[0].message
        assert ma.content == mb.content
        # Tool-call ids are random per backend call (as in sglang); names and arguments must agree.
        assert [(c.function.name, c.function.arguments) for c in ma.tool_calls or []] == [
            (c.function.name, c.function.arguments) for c in mb.tool_calls or []
        ]
        assert all(c.id and c.type == "function" for c in mb.tool_calls or [])
        assert a.choices[0].finish_reason == b.choices[0].finish_reason
        assert getattr(ma, "reasoning_content", None) == getattr(mb, "reasoning_content", None)
    assert len(plain_messages) == len(stream_messages)
    _, plain_ids = session_records(record_dir, plain_sid)
    _, stream_ids = session_records(record_dir, stream_sid)
    assert plain_ids == stream_ids
    # sglang >= 0.5.20 streams live: the streamed requests carried our input_ids and asked for the sglext ids.
    streamed = [body for body in fresh.received() if body["stream"]]
    assert len(streamed) == 4 and all(body["return_output_ids_in_sglext"] and body["input_ids"] for body in streamed)


def test_stream_wire_format(proxy, fresh) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    response = post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in response.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_session_from_path_prefix_and_automatic_sessions(proxy, fresh, record_dir) -> None:
    sid = f"path-{uuid.uuid4().hex[:6]}"
    client = openai.OpenAI(base_url=f"{proxy.url}/sessions/{sid}/v1", api_key=SECRET, max_retries=0)
    run_agent(client, 3)
    session_file, _ = session_records(record_dir, sid)
    assert [t.parent_turn_id for t in session_file.turns] == [None, 0, 1]
    # No header, no path: the messages themselves find the session.
    before = set(record_dir.glob("*.jsonl"))
    run_agent(agent(proxy), 3, first="Weather in Lisbon?")
    created = set(record_dir.glob("*.jsonl")) - before
    assert len(created) == 1
    auto = read_session_file(created.pop())
    assert [t.parent_turn_id for t in auto.turns] == [None, 0, 1]
    # ...and the reconstructed prompts extend each other.
    ids = auto.full_ids()
    assert ids[1][0][: len(ids[0][0]) + len(ids[0][1])] == ids[0][0] + ids[0][1]


def test_retries_and_edits_become_branches(proxy, fresh, record_dir) -> None:
    sid = f"branch-{uuid.uuid4().hex[:6]}"
    client = agent(proxy, sid)
    messages, _ = run_agent(client, 2)
    # Retry the last request verbatim, then a divergent tool result, then an edited first user message.
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    last_request = messages[:last_assistant]
    client.chat.completions.create(model="reference-model", messages=last_request, tools=TOOLS)
    client.chat.completions.create(model="reference-model", messages=last_request, tools=TOOLS)
    edited = [dict(m) for m in messages[:2]]
    edited[1]["content"] = "Weather in Rome?"
    client.chat.completions.create(model="reference-model", messages=edited, tools=TOOLS)
    session_file, ids = session_records(record_dir, sid)
    parents = [t.parent_turn_id for t in session_file.turns]
    assert parents == [None, 0, 0, 0, None]
    # Siblings share their parent's ids exactly.
    assert ids[2][0] == ids[1][0] == ids[3][0]


def test_concurrent_requests_on_one_turn_become_siblings(proxy, fresh, record_dir) -> None:
    import asyncio

    sid = f"conc-{uuid.uuid4().hex[:6]}"
    messages, _ = run_agent(agent(proxy, sid), 1)

    async def many() -> None:
        client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=SECRET, default_headers={"x-session-id": sid})
        await asyncio.gather(
            *(client.chat.completions.create(model="reference-model", messages=messages, tools=TOOLS) for _ in range(8))
        )
        await client.close()

    asyncio.run(many())
    session_file, ids = session_records(record_dir, sid)
    assert [t.parent_turn_id for t in session_file.turns] == [None] + [0] * 8
    assert sorted(t.turn_id for t in session_file.turns) == list(range(9))
    prompts = {tuple(ids[t][0]) for t in range(1, 9)}
    assert len(prompts) == 1, "every sibling must be built on the same stored ids"


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
    (b'{"messages": [{"content": "x"}]}', "messages.0.role"),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n must be 1"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "NaN"),
    (b'{"messages": [{"role": "user", "content": "x"}], "model": "a", "model": "b"}', "duplicate"),
    (b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', "data: URLs"),
    (b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{1}}"}}',
     "chat_template"),
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}', "tools"),
    (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "needle"), BAD_BODIES)
def test_bad_input_is_a_clean_400_that_changes_nothing(proxy, fresh, record_dir, body, needle) -> None:
    before = {p: p.stat().st_size for p in record_dir.glob("*.jsonl")}
    response = post(
        proxy.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"]
    assert fresh.received() == []
    assert {p: p.stat().st_size for p in record_dir.glob("*.jsonl")} == before


def test_disallowed_append_role_is_400_and_leaves_the_branch_usable(replica, record_dir, tmp_path) -> None:
    with Mitmdump(
        replica.url,
        tokenizer=tokenizer_path("qwen3"),
        record_dir=tmp_path / "rec",
        cwd=tmp_path,
        options={"tito_append_roles": "tool"},
    ) as proxy:
        replica.backend.reset()
        sid = "roles"
        client = agent(proxy, sid)
        first = client.chat.completions.create(
            model="reference-model", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS
        )
        history = [{"role": "user", "content": "Weather in Paris?"}, echo(first.choices[0].message)]
        with pytest.raises(openai.BadRequestError, match="tito_append_roles"):
            client.chat.completions.create(
                model="reference-model", messages=history + [{"role": "user", "content": "more"}], tools=TOOLS
            )
        call = first.choices[0].message.tool_calls[0]
        client.chat.completions.create(
            model="reference-model",
            messages=history + [{"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
            tools=TOOLS,
        )
        session_file = read_session_file(tmp_path / "rec" / "roles.jsonl")
        assert [t.parent_turn_id for t in session_file.turns] == [None, 0]


@pytest.mark.parametrize(
    ("fault", "status", "needle"),
    [
        ("http500", 500, "injected"),
        ("http429", 429, "injected"),
        ("http503", 503, "injected"),
        ("not_json", 502, "not JSON"),
        ("truncated_json", 502, "not JSON"),
        ("no_choices", 502, "without choices"),
        ("no_meta_info", 502, "meta_info"),
        ("length_mismatch", 502, "does not match"),
        ("empty_message", 502, "neither content"),
        ("wrong_prompt_ids", 502, "different prompt ids"),
        ("nan_logprob", 502, "finite"),
        ("reset", 502, "backend connection failed"),
        ("reset_early", 502, "backend connection failed"),
        ("stall", 504, "did not answer within"),
    ],
)
def test_upstream_faults_record_nothing_and_the_session_resumes(proxy, fresh, record_dir, fault, status, needle):
    sid = f"fault-{fault}-{uuid.uuid4().hex[:6]}"
    client = agent(proxy, sid)
    messages, _ = run_agent(client, 1)
    size = (record_dir / session_file_name(sid)).stat().st_size
    fresh.set_faults([fault])
    response = post(
        proxy.url + "/v1/chat/completions",
        json={"model": "reference-model", "messages": messages, "tools": TOOLS},
        headers={"x-session-id": sid},
        timeout=30,
    )
    assert response.status_code == status, response.text
    assert needle in response.text
    if fault.startswith("http"):
        assert response.json() == {"object": "error", "message": "injected", "code": status}  # verbatim
    assert (record_dir / session_file_name(sid)).stat().st_size == size, "a failed turn must record nothing"
    # The session resumes: the retry attaches to turn 0, as the failed request would have.
    client.chat.completions.create(model="reference-model", messages=messages, tools=TOOLS)
    session_file, _ = session_records(record_dir, sid)
    assert [t.parent_turn_id for t in session_file.turns] == [None, 0]


def test_a_failed_divergent_retry_leaves_the_original_branch_intact(proxy, fresh, record_dir) -> None:
    """Reference bug: a rollback applied before a later failure stayed committed."""
    sid = f"rollback-{uuid.uuid4().hex[:6]}"
    client = agent(proxy, sid)
    messages, _ = run_agent(client, 2)
    fresh.set_faults(["http500"])
    divergent = messages[:4] + [{"role": "tool", "tool_call_id": messages[2]["tool_calls"][0]["id"], "content": "x"}]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="reference-model", messages=divergent, tools=TOOLS)
    client.chat.completions.create(model="reference-model", messages=messages, tools=TOOLS)
    session_file, ids = session_records(record_dir, sid)
    assert [t.parent_turn_id for t in session_file.turns] == [None, 0, 1]
    assert ids[2][0][: len(ids[1][0]) + len(ids[1][1])] == ids[1][0] + ids[1][1]


def test_old_sglang_that_ignores_input_ids_is_refused(tmp_path) -> None:
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), honor_input_ids=False)
    with (
        ReplicaThread(config) as old,
        Mitmdump(old.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path) as proxy,
    ):
        response = post(
            proxy.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30
        )
        assert response.status_code == 502
        assert "0.5.13" in response.json()["error"]["message"]
        assert not list((tmp_path / "rec").glob("*.jsonl"))


def test_refused_backend_is_502(tmp_path) -> None:
    with Mitmdump(
        "http://127.0.0.1:9", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path
    ) as proxy:
        response = post(
            proxy.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30
        )
        assert response.status_code == 502
        assert "unreachable" in response.json()["error"]["message"]


def test_a_backend_gone_mid_session_is_502_and_the_session_resumes_when_it_returns(tmp_path) -> None:
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"))
    first = ReplicaThread(config).start()
    port = first.port
    with Mitmdump(first.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path) as proxy:
        client = agent(proxy, "backend-gone")
        messages, _ = run_agent(client, 1)
        path = tmp_path / "rec" / session_file_name("backend-gone")
        size = path.stat().st_size
        first.stop()  # refused from now on
        for _ in range(2):  # a pooled connection may fail first as a reset; then the refusal itself
            response = post(
                proxy.url + "/v1/chat/completions",
                json={"model": "reference-model", "messages": messages, "tools": TOOLS},
                headers={"x-session-id": "backend-gone"},
                timeout=30,
            )
            assert response.status_code == 502, response.text
            assert response.json()["error"]["type"] == "upstream_unavailable"
        assert "unreachable" in response.json()["error"]["message"]
        assert path.stat().st_size == size
        with ReplicaThread(config, port=port):
            client.chat.completions.create(model="reference-model", messages=messages, tools=TOOLS)
    recorded = read_session_file(path)
    assert [t.parent_turn_id for t in recorded.turns] == [None, 0]


def test_reasoning_only_reply_cut_by_max_tokens_is_served_and_recorded(proxy, fresh, record_dir) -> None:
    sid = f"cut-{uuid.uuid4().hex[:6]}"
    client = agent(proxy, sid)
    messages = [{"role": "user", "content": "Think hard about Paris."}]
    reply = client.chat.completions.create(model="reference-model", messages=messages, max_tokens=4)
    assert reply.choices[0].finish_reason == "length"
    session_file, ids = session_records(record_dir, sid)
    assert session_file.turns[0].finish_reason == "length" and len(ids[0][1]) == 4
    # The next turn closes the cut-off turn before the appended message.
    follow = messages + [echo(reply.choices[0].message), {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="reference-model", messages=follow)
    session_file, ids = session_records(record_dir, sid)
    tok = fresh.backend.tokenizer.tok
    added = session_file.turns[1].prompt_added_ids
    assert tok.decode(added).startswith("<|im_end|>\n<|im_start|>user\nGo on.")


def test_other_routes_pass_through_untouched(proxy, fresh) -> None:
    models = get(proxy.url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "reference-model"
    scoped = get(proxy.url + "/sessions/abc/v1/models", timeout=30)
    assert scoped.status_code == 200 and scoped.json()["object"] == "list"
    assert get(proxy.url + "/health", timeout=30).json() == {"status": "ok"}
    assert fresh.received() == []


def session_request(proxy, session_id: str, via: str, content: str):
    from urllib.parse import quote

    if via == "header":
        try:
            session_id.encode("latin-1")
        except UnicodeEncodeError:
            pytest.skip("HTTP headers carry latin-1 only")
        url, headers = proxy.url + "/v1/chat/completions", {"x-session-id": session_id}
    else:
        url, headers = f"{proxy.url}/sessions/{quote(session_id, safe='')}/v1/chat/completions", {}
    return post(url, json={"model": "m", "messages": [{"role": "user", "content": content}]}, headers=headers)


@pytest.mark.parametrize("via", ["header", "path"])
@pytest.mark.parametrize("session_id", ["a/b", "team/run-1", "with space", "日本語-セッション", "C:\\win", "x" * 200])
def test_ordinary_session_ids_are_mapped_into_the_record_dir(proxy, fresh, record_dir, session_id, via) -> None:
    before = set(record_dir.iterdir())
    response = session_request(proxy, session_id, via, f"Hi {via}")
    assert response.status_code == 200, response.text
    path = record_dir / session_file_name(session_id)
    assert path.parent == record_dir and path.is_file()
    assert set(record_dir.iterdir()) - before <= {path}
    assert json.loads(path.read_text("utf-8").splitlines()[0])["session_id"] == session_id
    naive = Path(str(record_dir) + "/" + session_id + ".jsonl")
    if record_dir.resolve() not in naive.resolve().parents:
        assert not naive.exists(), "a naive join would have written outside the record dir"


@pytest.mark.parametrize("via", ["header", "path"])
@pytest.mark.parametrize(
    "session_id",
    ["../escape", "../../etc/passwd", "/abs/path", "\\server\\share", "..", "a/../b", "a\\..\\b", "x" * 201,
     "tab\there", "nul\x00", "del\x7f", "c1\x85"],
)  # fmt: skip
def test_hostile_session_ids_are_400_and_write_nothing(proxy, fresh, record_dir, tmp_path, session_id, via) -> None:
    before = {p: p.stat().st_size for p in record_dir.iterdir()}
    response = session_request(proxy, session_id, via, f"Hi hostile {via}")
    assert response.status_code == 400, response.text
    assert "invalid session id" in response.json()["error"]["message"]
    assert fresh.received() == []
    assert {p: p.stat().st_size for p in record_dir.iterdir()} == before
    assert not (record_dir / session_file_name(session_id)).exists()


def test_invalid_session_ids_are_400(proxy, fresh) -> None:
    for bad in ["", "x" * 300]:
        response = post(
            proxy.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"x-session-id": bad},
            timeout=30,
        )
        assert response.status_code == 400
    for path in ("/sessions/a%00b/v1/chat/completions", "/sessions//v1/chat/completions"):
        refused = post(proxy.url + path, json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
        assert refused.status_code == 400 and "session id" in refused.json()["error"]["message"]
    assert fresh.received() == []


def test_no_secret_in_any_recording(proxy, record_dir) -> None:
    for path in record_dir.glob("*.jsonl"):
        text = path.read_text("utf-8")
        assert SECRET not in text and "authorization" not in text.lower()


def test_authorization_reaches_the_backend_but_not_the_body(proxy, fresh) -> None:
    agent(proxy, "auth-check").chat.completions.create(model="m", messages=[{"role": "user", "content": "auth?"}])
    headers = fresh.backend.received_headers[-1]
    assert headers.get("Authorization") == f"Bearer {SECRET}"
    assert "x-session-id" not in {k.lower() for k in headers}
    assert SECRET not in json.dumps(fresh.received())


def test_show_reconstructs_every_turn(proxy, fresh, record_dir) -> None:
    sid = f"show-{uuid.uuid4().hex[:6]}"
    run_agent(agent(proxy, sid), 5)
    generated = fresh.generated()
    out = subprocess.run(
        [sys.executable, "-m", "tito_addon", "show", str(record_dir), "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    mine = [r for r in rows if r["session_id"] == sid]
    assert [r["turn_id"] for r in mine] == list(range(5))
    for row, gen in zip(mine, generated, strict=True):
        assert row["prompt_ids"] == gen["prompt_ids"] and row["completion_ids"] == gen["completion_ids"]
        assert row["completion_logprobs"] == gen["logprobs"]
    summary = subprocess.run(
        [sys.executable, "-m", "tito_addon", "show", str(record_dir)], cwd=REPO, capture_output=True, text=True
    )
    assert summary.returncode == 0 and sid[:16] in summary.stdout


def test_python_m_entry_point_serves_turns(replica, tmp_path) -> None:
    replica.backend.reset()
    with Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, via_module=True
    ) as proxy:
        agent(proxy, "via-module").chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
        assert replica.received()[0]["input_ids"]
    assert (tmp_path / "rec" / "via-module.jsonl").is_file()
    lines = (tmp_path / "rec" / "via-module.jsonl").read_text("utf-8").splitlines()
    assert json.loads(lines[-1])["reason"] == "shutdown"


def test_unknown_backend_kind_and_bad_options_refuse_to_start(replica, tmp_path) -> None:
    for options, needle in [
        ({"tito_backend_kind": "tgi"}, "unknown backend kind"),
        ({"tito_model_family": "llama9"}, "unknown model family"),
        ({"tito_append_roles": "tool,wizard"}, "wizard"),
        ({"tito_chat_template_kwargs": "{not json"}, "tito_chat_template_kwargs"),
        ({"tito_model_family": "default"}, "tito_model_family=qwen3"),
        ({"tito_tokenizer": ""}, "tito_tokenizer is required"),
        ({"tito_routed_experts": "true"}, "tito_routed_experts on sglang needs tito_routed_experts_shape"),
        ({"tito_routed_experts_shape": "48by8"}, "is not LAYERSxTOPK"),
    ]:
        proxy = Mitmdump(
            replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, options=options
        )
        returncode, output = proxy.run_to_exit()
        assert returncode != 0 and needle in output, output[-3000:]


def test_request_template_kwargs_build_the_ids_and_reach_the_backend(proxy, fresh, record_dir) -> None:
    sid = f"kwargs-{uuid.uuid4().hex[:6]}"
    client = agent(proxy, sid)
    messages = [{"role": "user", "content": "Quick answer please."}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    first = client.chat.completions.create(model="reference-model", messages=messages, extra_body=off)
    messages += [echo(first.choices[0].message), {"role": "user", "content": "Again?"}]
    client.chat.completions.create(model="reference-model", messages=messages, extra_body=off)
    tok = fresh.backend.tokenizer.tok
    for body in fresh.received():
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
        assert tok.decode(body["input_ids"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    session_file, _ = session_records(record_dir, sid)
    assert [t.chat_template_kwargs for t in session_file.turns] == [{"enable_thinking": False}] * 2
    assert not any(getattr(r, "reasoning_content", None) for r in [first.choices[0].message])


def test_a_kwarg_that_shapes_only_the_generation_prompt_keeps_the_session_chained(proxy, fresh, record_dir) -> None:
    """Qwen3 `enable_thinking` changes only the generation prompt: toggling it mid-session still extends the stored
    ids (kwargs that re-render the history start a fresh root instead; see test_model_families)."""
    sid = f"toggle-{uuid.uuid4().hex[:6]}"
    client = agent(proxy, sid)
    messages = [{"role": "user", "content": "Quick answer please."}]
    first = client.chat.completions.create(
        model="reference-model", messages=messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    messages += [echo(first.choices[0].message), {"role": "user", "content": "Now think it through."}]
    client.chat.completions.create(model="reference-model", messages=messages)
    session_file, ids = session_records(record_dir, sid)
    assert [t.parent_turn_id for t in session_file.turns] == [None, 0]
    assert ids[1][0][: len(ids[0][0]) + len(ids[0][1])] == ids[0][0] + ids[0][1]
    assert [b["input_ids"] for b in fresh.received()] == [ids[0][0], ids[1][0]]


def test_flow_files_carry_the_turn_metadata(replica, tmp_path) -> None:
    from mitmproxy import io as mitm_io

    replica.backend.reset()
    flows_path = tmp_path / "flows.mitm"
    with Mitmdump(
        replica.url,
        tokenizer=tokenizer_path("qwen3"),
        record_dir=tmp_path / "rec",
        cwd=tmp_path,
        extra_args=["-w", str(flows_path)],
    ) as proxy:
        run_agent(agent(proxy, "flowfile"), 2)
    with flows_path.open("rb") as handle:
        flows = list(mitm_io.FlowReader(handle).stream())
    chats = [f for f in flows if f.request.path.endswith("/chat/completions")]
    assert [f.metadata["tito"]["turn_id"] for f in chats] == [0, 1]
    assert chats[1].metadata["tito"]["parent_turn_id"] == 0
    assert chats[1].metadata["tito"]["session_id"] == "flowfile"
    assert chats[1].metadata["tito"]["prompt_tokens"] == len(replica.received()[1]["input_ids"])
