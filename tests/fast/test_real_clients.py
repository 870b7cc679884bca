"""Real, unmodified clients through a real mitmdump, each asserting the recorded token trajectory: the openai npm
package on Node, curl, and the OpenAI Agents SDK running its own tool loop (openai-python: test_proxy_modes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.proxy_harness import REPO, Mitmdump, post

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaThread

NODE_DIR = REPO / "tests" / "node"


def trajectory_matches(record_dir: Path, replica: ReplicaThread) -> list:
    """Every recorded turn's ids are what the replica received and generated; returns the sessions' turns."""
    generated = {tuple(g["prompt_ids"]): g["completion_ids"] for g in replica.generated()}
    files = list(iter_session_files(record_dir))
    total = 0
    for session_file in files:
        ids = session_file.full_ids()
        previous: list[int] = []
        for turn in session_file.turns:
            prompt, completion = ids[turn.turn_id]
            assert generated[tuple(prompt)] == completion
            if turn.parent_turn_id is not None:
                assert prompt[: len(previous)] == previous
            previous = prompt + completion
            total += 1
    assert total == len(replica.generated())
    return [f.turns for f in files]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY") and not k.startswith("OPENAI_")}
    return {**env, "OPENAI_API_KEY": "sk-client", **extra}


@pytest.fixture(scope="module")
def node_agent() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are not installed")
    if not (NODE_DIR / "node_modules" / "openai").is_dir():
        subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300)
    return NODE_DIR / "agent.mjs"


@pytest.mark.parametrize("stream", [False, True])
def test_openai_npm_on_node_in_reverse_mode(proxy, replica, node_agent: Path, stream: bool) -> None:
    argv = ["node", str(node_agent), "3"] + (["stream"] if stream else [])
    result = subprocess.run(
        argv, env=clean_env(OPENAI_BASE_URL=proxy.url + "/v1"), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    replies = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["finish_reason"] for r in replies] == ["tool_calls", "stop", "tool_calls"]
    assert replies[0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    (turns,) = trajectory_matches(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 1]


def test_openai_npm_in_regular_mode(replica, node_agent: Path, tmp_path: Path) -> None:
    version = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip()
    major, minor = (int(x) for x in version.lstrip("v").split(".")[:2])
    if (major, minor) < (22, 21):
        pytest.skip(f"Node {version} ignores HTTP(S)_PROXY (NODE_USE_ENV_PROXY needs Node >= 22.21)")
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    with Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, mode="regular") as proxy:
        env = clean_env(OPENAI_BASE_URL=replica.url + "/v1", HTTP_PROXY=proxy.url, NODE_USE_ENV_PROXY="1")
        result = subprocess.run(["node", str(node_agent), "3"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (turns,) = trajectory_matches(record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 1]


def test_openai_npm_episode_named_by_its_api_key(replica, node_agent: Path, tmp_path: Path) -> None:
    """openai-node in reverse mode: `OPENAI_API_KEY=<prefix>EPISODE` names the session; the backend gets its own key."""
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {"tito_session_api_key_prefix": "sk-ep-", "tito_backend_api_key": "backend-SECRET-key-9d2e"}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options=options) as proxy:  # fmt: skip
        env = clean_env(OPENAI_BASE_URL=proxy.url + "/v1", OPENAI_API_KEY="sk-ep-node-episode")
        result = subprocess.run(["node", str(node_agent), "2"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (turns,) = trajectory_matches(record_dir, replica)
    assert {t.session_id for t in turns} == {"node-episode"} and [t.parent_turn_id for t in turns] == [None, 0]
    seen = {v for h in replica.backend.received_headers for k, v in h.items() if k.lower() == "authorization"}
    assert seen == {"Bearer backend-SECRET-key-9d2e"}


def test_curl_plain_and_streamed(proxy, replica) -> None:
    curl = shutil.which("curl")
    if not curl:
        pytest.skip("curl is not installed")
    url = proxy.url + "/v1/chat/completions"
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello from curl"}]}
    plain = subprocess.run(
        [curl, "-sS", "-H", "content-type: application/json", "-d", json.dumps(body), url],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    reply = json.loads(plain.stdout)
    follow = dict(body, stream=True, messages=body["messages"] + [reply["choices"][0]["message"],
                  {"role": "user", "content": "Again"}])  # fmt: skip
    streamed = subprocess.run(
        [curl, "-sSN", "-H", "content-type: application/json", "-d", json.dumps(follow), url],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    events = [line[6:] for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
    (turns,) = trajectory_matches(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0]


def test_openai_agents_sdk_tool_loop(proxy, replica) -> None:
    pytest.importorskip("agents")
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "agents" / "agents_sdk_agent.py")],
        env=clean_env(OPENAI_BASE_URL=proxy.url + "/v1", OPENAI_AGENTS_DISABLE_TRACING="1"),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(runs) == 2 and all(run["output"] for run in runs)
    sessions = trajectory_matches(proxy.record_dir, replica)
    # The SDK ran the loop itself: call a tool, read its result, answer; then again after a new user message.
    assert sum(len(turns) for turns in sessions) == len(replica.received()) >= 4
    assert len(sessions) == 1, "the framework's second run continued the same conversation"
    (turns,) = sessions
    assert [t.parent_turn_id for t in turns] == [None, *range(len(turns) - 1)]


def test_reasoning_echoed_trimmed_extends_the_turn(proxy, replica) -> None:
    """Qwen Code keeps each thought trimmed in its history (Qwen3's reasoning comes as "\\n…\\n") and echoes it so,
    in both reasoning fields, beside `content: ""`, compact arguments and text-part tool results: the request still
    extends the stored turn's exact ids. A reasoning that says something else is another history (a new root)."""
    url = proxy.url + "/v1/chat/completions"
    shell = {"type": "function", "function": {"name": "run_shell_command", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}  # fmt: skip
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "ls"}]}]
    reply = post(url, json={"model": "m", "messages": first, "tools": [shell]})
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    reasoning, calls = message["reasoning_content"], message["tool_calls"]
    assert reasoning != reasoning.strip() and calls
    compact = []
    for call in calls:
        arguments = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
        compact.append({**call, "function": {**call["function"], "arguments": arguments}})
    results = [{"role": "tool", "tool_call_id": c["id"], "content": [{"type": "text", "text": "a.txt"}]} for c in calls]
    for thought in (reasoning.strip(), "Another thought."):
        echoed = {"role": "assistant", "content": "", "tool_calls": compact, "reasoning_content": thought,
                  "reasoning": thought}  # fmt: skip
        answer = post(url, json={"model": "m", "messages": [*first, echoed, *results], "tools": [shell]})
        assert answer.status_code == 200, answer.text
    turns = [t for session in trajectory_matches(proxy.record_dir, replica) for t in session]
    assert [t.parent_turn_id for t in turns] == [None, 0, None]
