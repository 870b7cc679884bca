"""Rollout drivers: episodes named without touching the agent (proxy auth, API key), and the control API that lists,
fetches, scores, waits on and closes them, through a real mitmdump with unmodified openai-python agents."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import httpx2
import openai
import pyarrow.parquet as pq
import pytest
from support.basics import tokenizer_path
from support.chat_agent import AGENT
from support.proxy_harness import REPO, Mitmdump, post

from tito_addon.client import AsyncTitoClient, TitoClient, TitoControlError, episode_api_key, episode_proxy_url
from tito_addon.records.record_reader import read_session
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

TOKEN = "control-token-0123456789abcdef"
KEY_PREFIX = "sk-ep-"
BACKEND_KEY = "backend-SECRET-key-9d2e"  # also in support.basics.API_KEYS: no log or record may show it


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


def run_agent(env: dict[str, str], turns: int, mode: str = "sync", check: bool = True) -> list[dict]:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and k != "OPENAI_BASE_URL"}
    result = subprocess.run(
        [sys.executable, str(AGENT), str(turns), mode],
        env={**clean, "OPENAI_API_KEY": "sk-agent", "NO_PROXY": "", **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()] if result.returncode == 0 else [result.stderr]


def export_bytes(record_dir: Path, tmp_path: Path, session: str, fmt: str, to: str) -> bytes:
    out = tmp_path / f"export-{session}-{fmt}.{to}"
    argv = [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), "--session", session]
    result = subprocess.run([*argv, "--format", fmt, "--to", to], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out.read_bytes()


def through_proxy(proxy: str, method: str, url: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
    """One raw request through the proxy (absolute-form, as any HTTP client sends to a proxy)."""
    import asyncio

    async def call() -> tuple[int, bytes]:
        async with aiohttp.ClientSession(trust_env=False) as session:
            async with session.request(method, url, headers=headers, data=body, proxy=proxy) as reply:
                return reply.status, await reply.read()

    return asyncio.run(call())


def record_bytes(record_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(record_dir.glob("*.jsonl"))}


def test_regular_mode_episodes_by_proxy_auth_and_the_control_api(replica, tmp_path: Path) -> None:
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {"tito_control_token": TOKEN}
    with Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, mode="regular",
                  options=options) as proxy:  # fmt: skip
        run_agent({"OPENAI_BASE_URL": replica.url + "/v1", "HTTP_PROXY": episode_proxy_url(proxy.url, "ep-a")}, 3)
        run_agent(
            {"OPENAI_BASE_URL": replica.url + "/v1", "HTTP_PROXY": episode_proxy_url(proxy.url, "ep-b")}, 2, "stream"
        )
        # The name comes from the proxy user alone; the header never reaches the backend.
        assert all("proxy-authorization" not in {k.lower() for k in h} for h in replica.backend.received_headers)
        a, b = read_session(record_dir, "ep-a"), read_session(record_dir, "ep-b")
        assert a is not None and b is not None
        assert [t.parent_turn_id for t in a.turns] == [None, 0, 1] and [t.parent_turn_id for t in b.turns] == [None, 0]
        ids = a.full_ids()
        for turn, generated in zip(a.turns, replica.generated()[:3], strict=True):
            assert ids[turn.turn_id] == (generated["prompt_ids"], generated["completion_ids"])

        with TitoClient(proxy.url, TOKEN) as tito:
            listed = {row["session_id"]: row for row in tito.sessions()}
            assert set(listed) == {"ep-a", "ep-b"}
            assert (listed["ep-a"]["turns"], listed["ep-a"]["branches"], listed["ep-a"]["live"]) == (3, 1, True)
            tokens = sum(len(t.prompt_added_ids) + len(t.completion_ids) for t in a.turns)
            assert listed["ep-a"]["tokens"] == tokens and listed["ep-b"]["turns"] == 2
            assert [row["session_id"] for row in tito.sessions(live=True)] == ["ep-b", "ep-a"]
            assert tito.wait_idle("ep-a", timeout_s=5) is True

            # Rows: the export's own bytes, in every layout.
            for fmt in ("generic", "verl", "slime"):
                fetched = tito.rows_parquet("ep-a", format=fmt)
                assert fetched == export_bytes(record_dir, tmp_path, "ep-a", fmt, "parquet"), fmt
            (row,) = tito.rows("ep-a")
            full_prompt, completion = ids[2]
            assert row["input_ids"] == full_prompt + completion and row["reward"] is None

            # A reward for the session, labels on its last turn: carried into the rows, replay-neutral lines.
            tito.annotate("ep-a", reward=0.75, metadata={"task": "weather", "seed": 7})
            tito.annotate("ep-a", turn_id=2, labels=["solved"], metadata={"seed": 8})
            (row,) = tito.rows("ep-a")
            assert (row["reward"], row["labels"], json.loads(row["metadata"])) == (
                0.75, ["solved"], {"task": "weather", "seed": 8}
            )  # fmt: skip
            table = pq.read_table(_write(tmp_path, tito, "ep-a"))
            assert table.column("reward").to_pylist() == [0.75]

            with pytest.raises(TitoControlError) as missing:
                tito.annotate("ep-a", turn_id=9, reward=1.0)
            assert missing.value.status == 404
            with pytest.raises(TitoControlError) as unknown:
                tito.session("ep-zz")
            assert unknown.value.status == 404

            closed = tito.close("ep-a")
            assert closed == {"session_id": "ep-a", "closed": True, "turns": 3, "already_closed": False}
            assert tito.session("ep-a")["closed"] == "closed" and tito.session("ep-a")["live"] is False
            before, served = record_bytes(record_dir), len(replica.received())
            # The closed name is refused (tito_after_close=refuse): a final 410, nothing forwarded, nothing written.
            refused = run_agent(
                {"OPENAI_BASE_URL": replica.url + "/v1", "HTTP_PROXY": episode_proxy_url(proxy.url, "ep-a")}, 1,
                check=False,
            )  # fmt: skip
            assert "410" in refused[0] and "closed by its driver" in refused[0]
            named = httpx2.Client(proxy=episode_proxy_url(proxy.url, "ep-a"), trust_env=False)
            agent = openai.OpenAI(base_url=replica.url + "/v1", api_key="sk-agent", http_client=named, max_retries=0)
            with pytest.raises(openai.APIStatusError, match="closed by its driver") as gone:
                agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
            assert gone.value.status_code == 410 and gone.value.response.headers["x-should-retry"] == "false"
            assert gone.value.body["type"] == "session_closed"
            assert record_bytes(record_dir) == before and len(replica.received()) == served
            assert tito.close("ep-a")["already_closed"] is True
            assert record_bytes(record_dir) == before
    closes = read_session(record_dir, "ep-a")
    assert closes is not None and [c.reason for c in closes.closes] == ["closed"]
    assert [n.reward for n in closes.annotations] == [0.75, None]


def _write(tmp_path: Path, tito: TitoClient, session: str) -> Path:
    path = tmp_path / f"{session}.slime.parquet"
    path.write_bytes(tito.rows_parquet(session, format="slime"))
    return path


def test_reverse_mode_episodes_by_api_key(replica, tmp_path: Path) -> None:
    """The backend sees its real key, never the episode's; neither is recorded or logged (the session-wide audit in
    conftest checks every log and record for both)."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {
        "tito_session_api_key_prefix": KEY_PREFIX,
        "tito_backend_api_key": BACKEND_KEY,
        "tito_control_token": TOKEN,
    }
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options=options) as proxy:  # fmt: skip
        key = episode_api_key(KEY_PREFIX, "ep-r")
        run_agent({"OPENAI_BASE_URL": proxy.url + "/v1", "OPENAI_API_KEY": key}, 2)
        run_agent({"OPENAI_BASE_URL": proxy.url + "/v1", "OPENAI_API_KEY": key}, 1, "stream")
        # An ordinary key passes untouched and names nothing.
        run_agent({"OPENAI_BASE_URL": proxy.url + "/v1", "OPENAI_API_KEY": "sk-agent"}, 1)
        seen = [h.get("Authorization") or h.get("authorization") for h in replica.backend.received_headers]
        assert seen == [f"Bearer {BACKEND_KEY}"] * 3 + ["Bearer sk-agent"]
        session = read_session(record_dir, "ep-r")
        assert session is not None and [t.parent_turn_id for t in session.turns] == [None, 0, None]
        # The control API through the same (reverse-mode) port.
        with TitoClient(proxy.url, TOKEN) as tito:
            assert {row["session_id"] for row in tito.sessions()} >= {"ep-r"}
            assert tito.session("ep-r")["turns"] == 3
    text = proxy.output() + "".join(p.read_text() for p in record_dir.glob("*.jsonl"))
    assert key not in text and BACKEND_KEY not in text


def test_a_drivers_name_wins_over_the_agents_own_session_header(replica, tmp_path: Path) -> None:
    """opencode sends `X-Session-Id: ses_…` (its own session id) on every request: the episode its API key names, and
    a `/sessions/{id}/` base URL, name the session all the same; the header names it only when nothing else does."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {"tito_session_api_key_prefix": KEY_PREFIX, "tito_backend_api_key": BACKEND_KEY}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options=options) as proxy:  # fmt: skip
        own = {"X-Session-Id": "ses_own", "x-session-affinity": "ses_own"}  # as opencode 1.18.33 sends them
        keyed = {**own, "Authorization": "Bearer " + episode_api_key(KEY_PREFIX, "oc-ep")}
        for path, headers in (
            ("/v1/chat/completions", keyed),
            ("/sessions/by-path/v1/chat/completions", keyed),
            ("/sessions/by-path/v1/chat/completions", {**own, "Authorization": "Bearer sk-agent"}),
            ("/v1/chat/completions", {**own, "Authorization": "Bearer sk-agent"}),
        ):
            body = {"model": "m", "messages": [{"role": "user", "content": f"Hello via {path}"}]}
            reply = post(proxy.url + path, json=body, headers=headers)
            assert reply.status_code == 200, reply.text
    named = {name: read_session(record_dir, name) for name in ("oc-ep", "by-path", "ses_own")}
    assert {name: len(s.turns) if s else 0 for name, s in named.items()} == {"oc-ep": 1, "by-path": 2, "ses_own": 1}
    seen = [h.get("Authorization") or h.get("authorization") for h in replica.backend.received_headers]
    assert seen == [f"Bearer {BACKEND_KEY}"] * 2 + ["Bearer sk-agent"] * 2


def test_the_backend_gets_its_key_as_a_bearer_whatever_header_named_the_episode(replica, tmp_path: Path) -> None:
    """An episode key in `x-api-key` (Anthropic clients) or `x-goog-api-key` (Gemini clients) names the episode as
    one in `Authorization` does, and the backend's key goes to the backend as `Authorization: Bearer`, the one header
    sglang's and vLLM's `--api-key` read; no episode key and no other key header reaches it."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {"tito_session_api_key_prefix": KEY_PREFIX, "tito_backend_api_key": BACKEND_KEY}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options=options) as proxy:  # fmt: skip
        messages = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hello, Messages."}]}
        gemini = {"contents": [{"role": "user", "parts": [{"text": "Hello, Gemini."}]}]}
        for path, body, header in (
            ("/v1/messages", messages, "x-api-key"),
            ("/v1beta/models/m:generateContent", gemini, "x-goog-api-key"),
        ):
            key = episode_api_key(KEY_PREFIX, f"by-{header}")
            reply = post(proxy.url + path, json=body, headers={header: key})
            assert reply.status_code == 200, reply.text
    for header in ("x-api-key", "x-goog-api-key"):
        session = read_session(record_dir, f"by-{header}")
        assert session is not None and len(session.turns) == 1, header
    seen = [{k.lower(): v for k, v in h.items()} for h in replica.backend.received_headers]
    keys = [{name: h[name] for name in ("authorization", "x-api-key", "x-goog-api-key") if name in h} for h in seen]
    assert keys == [{"authorization": f"Bearer {BACKEND_KEY}"}] * 2, keys


def test_id_less_grpo_siblings_share_an_automatic_group(replica, tmp_path: Path) -> None:
    """Three unnamed agents sending the same first request (GRPO siblings with no id) and one asking something else:
    one rows call over their automatic sessions gives the siblings one group of three episodes, each its own rollout,
    and the other agent a group of its own, which a group size of 3 leaves out."""
    import openai

    replica.backend.reset()
    record_dir = tmp_path / "rec"
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options={"tito_control_token": TOKEN}) as proxy:  # fmt: skip
        for _ in range(3):
            run_agent({"OPENAI_BASE_URL": proxy.url + "/v1"}, 1)
        other = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-agent", max_retries=0)
        other.chat.completions.create(model="m", messages=[{"role": "user", "content": "Something else entirely?"}])
        with TitoClient(proxy.url, TOKEN) as tito:
            sessions = [row["session_id"] for row in tito.sessions()]
            summary = tito.export_rows(sessions, format="verl", to="summary")
            rows = tito.export_rows(sessions, format="verl", group_size=3, group_policy="drop")
    sizes = sorted((g["episodes"], g["rows"]) for g in summary["groups"])
    assert sizes == [(1, 1), (3, 3)] and all(g["group"].startswith("auto-") for g in summary["groups"])
    assert len(rows) == 3 and len({r["uid"] for r in rows}) == 1 and len({r["episode"] for r in rows}) == 3
    assert [r["rollout_id"] for r in rows] == [r["index"] for r in rows] == [0, 1, 2]
    assert len({tuple(r["prompts"]) for r in rows}) == 1, "the siblings' first prompts are one prompt"


def test_after_close_new_starts_a_new_tree_under_the_name(replica, tmp_path: Path) -> None:
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {"tito_control_token": TOKEN, "tito_after_close": "new"}
    with Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, mode="regular",
                  options=options) as proxy:  # fmt: skip
        env = {"OPENAI_BASE_URL": replica.url + "/v1", "HTTP_PROXY": episode_proxy_url(proxy.url, "ep-n")}
        run_agent(env, 2)
        with TitoClient(proxy.url, TOKEN) as tito:
            assert tito.close("ep-n")["turns"] == 2
        run_agent(env, 2)  # the same conversation again: a new tree, not a continuation of the closed one
    session = read_session(record_dir, "ep-n")
    assert session is not None
    assert [(t.turn_id, t.parent_turn_id) for t in session.turns] == [(0, None), (1, 0), (2, None), (3, 2)]


def test_the_control_api_needs_its_token_and_is_absent_without_one(replica, tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options={"tito_control_token": TOKEN}) as proxy:  # fmt: skip
        run_agent({"OPENAI_BASE_URL": proxy.url + "/v1"}, 1)
        replies = []
        for auth in ({}, {"authorization": "Bearer wrong-token-0123456789"}, {"authorization": TOKEN}):
            for method, path in (("GET", "/v1/sessions"), ("GET", "/v1/sessions/x/rows"),
                                 ("POST", "/v1/sessions/x/close"), ("GET", "/nothing/here")):  # fmt: skip
                replies.append(through_proxy(proxy.url, method, "http://tito.control" + path, auth))
        assert {status for status, _ in replies} == {401}
        assert len({body for _, body in replies}) == 1, "every refusal is the same: nothing is revealed"
    # Without a token the host is not served: the request goes where it was going (here: the reverse target).
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy:
        status, body = through_proxy(
            proxy.url, "GET", "http://tito.control/v1/sessions", {"authorization": f"Bearer {TOKEN}"}
        )
    assert status == 404 and b"sessions" not in body  # the replica's own 404


async def test_async_client_waits_for_a_turn_in_flight(replica, tmp_path: Path) -> None:
    """wait_idle returns only once a slow turn in flight has finished; the rows then hold it."""
    import asyncio

    replica.backend.reset()
    record_dir = tmp_path / "rec"
    env = {"OPENAI_BASE_URL": "/sessions/ep-w/v1"}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options={"tito_control_token": TOKEN}) as proxy:  # fmt: skip
        env = {"OPENAI_BASE_URL": proxy.url + "/sessions/ep-w/v1"}
        run_agent(env, 1)
        replica.backend.config.latency_s = 1.5
        try:
            agent = asyncio.create_task(asyncio.to_thread(run_agent, env, 1))
            async with AsyncTitoClient(proxy.url, TOKEN) as tito:
                for _ in range(200):
                    if (await tito.session("ep-w"))["in_flight"]:
                        break
                    await asyncio.sleep(0.02)
                assert (await tito.session("ep-w"))["in_flight"] == 1
                assert await tito.wait_idle("ep-w", timeout_s=30) is True
                assert (await tito.session("ep-w"))["in_flight"] == 0
                rows = await tito.rows("ep-w")
                assert sorted(len(r["turn_ids"]) for r in rows) == [1, 1]  # the retried first turn: a sibling
            await agent
        finally:
            replica.backend.config.latency_s = 0.0


def test_https_tunnels_are_named_by_their_connect_and_a_password_can_be_required(replica, tmp_path: Path) -> None:
    """HTTPS through the proxy: the name rides on the CONNECT and names every request in the tunnel. With
    tito_proxy_auth_password set, a wrong or missing password is a 407 and nothing is forwarded or recorded."""
    replica.backend.reset()
    record_dir, confdir = tmp_path / "rec", tmp_path / "conf"
    options = {
        "tito_backends": f"api.openai.example={replica.url}", "confdir": str(confdir),
        "tito_proxy_auth_password": "pw-0123",
    }  # fmt: skip
    with Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, mode="regular",
                  options=options) as proxy:  # fmt: skip

        def env(proxy_url: str) -> dict[str, str]:
            ca = str(confdir / "mitmproxy-ca-cert.pem")
            base = "https://api.openai.example/v1"
            return {"OPENAI_BASE_URL": base, "HTTPS_PROXY": proxy_url, "HTTP_PROXY": proxy_url, "SSL_CERT_FILE": ca}

        run_agent(env(episode_proxy_url(proxy.url, "ep-tls", "pw-0123")), 3)
        for wrong in (episode_proxy_url(proxy.url, "ep-x", "nope"), episode_proxy_url(proxy.url, "ep-x"), proxy.url):
            refused = run_agent(env(wrong), 1, check=False)
            assert "407" in refused[0], refused[0][-500:]
    session = read_session(record_dir, "ep-tls")
    assert session is not None and [t.parent_turn_id for t in session.turns] == [None, 0, 1]
    assert len(replica.received()) == 3 and sorted(p.name for p in record_dir.glob("*.jsonl")) == ["ep-tls.jsonl"]
