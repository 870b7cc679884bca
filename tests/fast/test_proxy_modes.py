"""Proxy modes with real, unmodified clients configured only through their environment: reverse and regular
mode (HTTP and TLS with the mitmproxy CA), backend host filtering, and several backends behind one proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.chat_agent import AGENT
from support.proxy_harness import Mitmdump
from support.upstream_tap import UpstreamTap

from tito_addon.backends.backend_routes import BackendRoutes, parse_backends
from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


def run_agent(env: dict[str, str], turns: int = 3, mode: str = "sync") -> list[dict]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and k != "OPENAI_BASE_URL"}
    result = subprocess.run(
        [sys.executable, str(AGENT), str(turns), mode],
        env={**clean, "OPENAI_API_KEY": "sk-agent", **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def assert_token_exact(record_dir: Path, replica: ReplicaThread, turns: int) -> None:
    (session_file,) = list(iter_session_files(record_dir))
    ids = session_file.full_ids()
    generated = replica.generated()
    assert [t.parent_turn_id for t in session_file.turns] == [None, *range(turns - 1)]
    for turn, gen in zip(session_file.turns, generated, strict=True):
        assert ids[turn.turn_id] == (gen["prompt_ids"], gen["completion_ids"])


def test_routes_unit() -> None:
    routes = BackendRoutes(entries=parse_backends("api.example.com=http://10.0.0.1:8000/v1, LOCAL:30000"))
    assert routes.resolve(reverse=False, scheme="https", host="api.example.com", port=443) == "http://10.0.0.1:8000"
    assert routes.resolve(reverse=False, scheme="http", host="local", port=30000) == "http://local:30000"
    assert routes.resolve(reverse=False, scheme="http", host="local", port=30001) is None
    assert routes.resolve(reverse=True, scheme="http", host="elsewhere", port=80) is None
    open_routes = BackendRoutes(backend_url="http://b:1")
    assert open_routes.resolve(reverse=False, scheme="http", host="x", port=1) == "http://b:1"
    assert open_routes.resolve(reverse=True, scheme="http", host="x", port=1) == "http://x:1"
    with pytest.raises(ValueError):
        parse_backends("a/b=http://x")


@pytest.mark.parametrize("mode", ["sync", "async", "stream"])
def test_reverse_mode_with_openai_python(replica, tmp_path: Path, mode: str) -> None:
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy:
        replies = run_agent({"OPENAI_BASE_URL": proxy.url + "/v1"}, 3, mode)
    assert [r["finish_reason"] for r in replies] == ["tool_calls", "stop", "tool_calls"]
    assert_token_exact(record_dir, replica, 3)


def test_regular_mode_over_http_proxy(replica, tmp_path: Path) -> None:
    """The agent keeps its base URL (the backend itself) and only sets HTTP_PROXY."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    with Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, mode="regular") as proxy:
        replies = run_agent({"OPENAI_BASE_URL": replica.url + "/v1", "HTTP_PROXY": proxy.url, "NO_PROXY": ""})
    assert len(replies) == 3
    assert_token_exact(record_dir, replica, 3)
    assert all("input_ids" in body for body in replica.received()), "every turn went through the addon"


def test_regular_mode_tls_with_the_mitmproxy_ca_and_host_filtering(replica, tmp_path: Path) -> None:
    """An agent hard-wired to a public HTTPS API host is served by the local backend; other hosts pass through."""
    replica.backend.reset()
    record_dir, confdir = tmp_path / "rec", tmp_path / "conf"
    other = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3")))
    with other, UpstreamTap(other.url) as untouched:
        with Mitmdump(
            "",
            tokenizer=tokenizer_path("qwen3"),
            record_dir=record_dir,
            cwd=tmp_path,
            mode="regular",
            options={"tito_backends": f"api.openai.example={replica.url}", "confdir": str(confdir)},
        ) as proxy:
            env = {
                "OPENAI_BASE_URL": "https://api.openai.example/v1",
                "HTTPS_PROXY": proxy.url,
                "HTTP_PROXY": proxy.url,
                "NO_PROXY": "",
                "SSL_CERT_FILE": str(confdir / "mitmproxy-ca-cert.pem"),
            }
            replies = run_agent(env)
            assert len(replies) == 3
            # A chat request to a host that is not a configured backend reaches it raw.
            raw = run_agent({"OPENAI_BASE_URL": untouched.url + "/v1", "HTTP_PROXY": proxy.url, "NO_PROXY": ""}, 1)
            assert len(raw) == 1
    assert_token_exact(record_dir, replica, 3)
    forwarded = untouched.of("/v1/chat/completions")
    assert len(forwarded) == 1 and "input_ids" not in forwarded[0]["request"]
    assert len(list(iter_session_files(record_dir))) == 1, "the pass-through request recorded nothing"


def test_several_backends_behind_one_proxy(tmp_path: Path) -> None:
    """Two backends, chosen by the agent's target host; each records its own sessions."""
    first = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3")))
    second = ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3")))
    record_dir = tmp_path / "rec"
    with (
        first,
        second,
        Mitmdump(
            "",
            tokenizer=tokenizer_path("qwen3"),
            record_dir=record_dir,
            cwd=tmp_path,
            mode="regular",
            options={"tito_backends": f"alpha.internal={first.url},beta.internal={second.url}"},
        ) as proxy,
    ):
        run_agent({"OPENAI_BASE_URL": "http://alpha.internal/v1", "HTTP_PROXY": proxy.url}, 2)
        run_agent({"OPENAI_BASE_URL": "http://beta.internal/v1", "HTTP_PROXY": proxy.url}, 3)
    assert len(first.received()) == 2 and len(second.received()) == 3
    lengths = sorted(len(f.turns) for f in iter_session_files(record_dir))
    assert lengths == [2, 3]
