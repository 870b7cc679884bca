"""The real Claude Code and Codex CLIs, unmodified, through a real mitmdump to the sglang replica: every turn token
exact, tool round trips and a second invocation (`--continue`, `resume --last`) on one chain of exact ids.

Command lines (run from a scratch project directory, HOME a scratch directory, nothing else inherited):

    ANTHROPIC_BASE_URL=http://127.0.0.1:PORT ANTHROPIC_API_KEY=KEY CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 \
        claude -p PROMPT --allowedTools Bash --output-format stream-json --verbose
        claude -p --continue PROMPT2 --allowedTools Bash --output-format stream-json --verbose

    CODEX_HOME=DIR LOCAL_KEY=KEY (DIR/config.toml: CODEX_CONFIG below)
        codex exec --skip-git-repo-check --json -m qwen3 PROMPT </dev/null
        codex exec --skip-git-repo-check --json -m qwen3 resume --last PROMPT2 </dev/null

The stack (the loopback-only namespace, the pinned CLIs, the steered replica) is support/agent_cli_stack.py's. Where the
namespace is refused, the CLIs' own switches keep them home: the environment above, and Codex's update check,
analytics and feedback off in its config.toml (agent_cli_stack.CODEX_CONFIG).
"""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    CODEX_CONFIG,
    COMMAND,
    MARKER,
    TOOL_ROUNDS,
    HostLoopback,
    Network,
    agent_clis,
    assert_exact_chain,
    base_env,
    namespaced_proxy,
    network,
    run_cli,
    steered_replica,
    text_of,
)
from support.basics import API_KEYS, tokenizer_path
from support.proxy_harness import REPO, Mitmdump

from tito_addon.records.record_reader import iter_session_files

# The full tier, alone on the machine: the real CLIs (an 800 MB npm install the first time) under their own timeouts.
pytestmark = [pytest.mark.full, pytest.mark.serial]

PREFERRED_TOOLS = {
    "Bash": {"command": COMMAND, "description": "Print a marker"},  # Claude Code
    "exec_command": {"cmd": COMMAND},  # Codex
}
API_KEY = API_KEYS[0]  # one the session-wide audit looks for in every proxy log and recording


@pytest.fixture(scope="module")
def replica(network):
    with steered_replica(network, PREFERRED_TOOLS) as running:
        yield running


@pytest.fixture
def proxy(network, replica, tmp_path: Path):
    with namespaced_proxy(network, replica, tmp_path) as running:
        yield running


# ---------------------------------------------------------------------------------------------- tests


def test_the_namespace_holds_only_loopback(network: Network) -> None:
    if isinstance(network, HostLoopback):
        pytest.skip("no network namespace here")
    shown = subprocess.run(network.command(["ip", "-o", "link", "show"]), capture_output=True, text=True, timeout=30)
    links = [line.split(":")[1].strip() for line in shown.stdout.splitlines()]
    assert links == ["lo"], shown.stdout
    assert network.inode != os.readlink("/proc/self/ns/net")  # what the CLIs' shell commands print is telling


def test_claude_code_cli_is_token_exact(
    network: Network, agent_clis: Path, proxy: Mitmdump, replica, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    env = base_env(
        tmp_path / "home",
        agent_clis,
        ANTHROPIC_BASE_URL=proxy.url,
        ANTHROPIC_API_KEY=API_KEY,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )
    # The prompt goes before --allowedTools, which takes a list.
    tail = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
    claude = str(agent_clis / "claude")
    first = run_cli(network, [claude, "-p", "Check this folder with Bash.", *tail], env=env, cwd=project)
    first_turns = len(replica.generated())
    second = run_cli(network, [claude, "-p", "--continue", "Check it once more.", *tail], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_chain(proxy, replica, "anthropic_messages", printed, invocations=2)
    # What the CLI saw: a successful result per invocation, and every Bash call ran in the namespace.
    for run in (first, second):
        events = run.events()
        result = events[-1]
        assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], str(run)
        uses = [
            block
            for event in events
            if event["type"] == "assistant"
            for block in event["message"]["content"]
            if block["type"] == "tool_use"
        ]
        outputs = [
            block
            for event in events
            if event["type"] == "user"
            for block in event["message"]["content"]
            if isinstance(block, dict) and block.get("type") == "tool_result"
        ]
        # One round per invocation is the replica's parallel turn (every third turn of the session): two calls.
        assert [u["name"] for u in uses] == ["Bash"] * (TOOL_ROUNDS + 1), str(run)
        assert len(outputs) == len(uses) and all(printed in text_of(o["content"]) for o in outputs), outputs
        assert not any(o.get("is_error") for o in outputs), outputs
    # The new prompt is what the second invocation appended to the stored history.
    appended = turns[first_turns].appended_messages
    assert appended[-1]["role"] == "user" and "Check it once more." in text_of(appended[-1]["content"])


def test_codex_cli_is_token_exact(network: Network, agent_clis: Path, proxy: Mitmdump, replica, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    codex_home = tmp_path / "codex_home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=proxy.url))
    env = base_env(tmp_path / "home", agent_clis, CODEX_HOME=str(codex_home), LOCAL_KEY=API_KEY)
    codex = [str(agent_clis / "codex"), "exec", "--skip-git-repo-check", "--json", "-m", "qwen3"]
    first = run_cli(network, [*codex, "Check this folder with the shell."], env=env, cwd=project)
    first_turns = len(replica.generated())
    second = run_cli(network, [*codex, "resume", "--last", "Check it once more."], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_chain(proxy, replica, "openai_responses", printed, invocations=2)
    threads = set()
    for run in (first, second):
        events = run.events()
        threads |= {event["thread_id"] for event in events if event["type"] == "thread.started"}
        assert events[-1]["type"] == "turn.completed", str(run)
        commands = [
            event["item"]
            for event in events
            if event["type"] == "item.completed" and event["item"]["type"] == "command_execution"
        ]
        assert len(commands) == TOOL_ROUNDS + 1, str(run)  # one round is the replica's parallel turn: two calls
        assert all(c["exit_code"] == 0 and printed in c["aggregated_output"] for c in commands), commands
    assert len(threads) == 1  # `resume --last` picked up the first invocation's thread
    appended = turns[first_turns].appended_messages
    assert appended[-1]["role"] == "user" and "Check it once more." in text_of(appended[-1]["content"])


def test_cli_episodes_are_named_by_their_api_key(network: Network, agent_clis: Path, replica, tmp_path: Path) -> None:
    """Claude Code (`ANTHROPIC_API_KEY`) and Codex (its provider's `env_key`) name their episode with a key of the
    configured form; the backend sees only its own key. Then the example driver runs two Claude Code episodes the same
    way, scores and closes them, and writes their rows (all of it inside the namespace)."""
    replica.backend.reset()
    record_dir, token, prefix, backend_key = tmp_path / "rec", "cli-control-token-0123456789", "sk-ep-", API_KEYS[1]
    options = {"tito_session_api_key_prefix": prefix, "tito_backend_api_key": backend_key, "tito_control_token": token}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  launcher=network.command([]), options=options) as proxy:  # fmt: skip
        project = tmp_path / "project"
        project.mkdir()
        tail = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
        claude_env = base_env(tmp_path / "home", agent_clis, ANTHROPIC_BASE_URL=proxy.url,
                              ANTHROPIC_API_KEY=prefix + "cc-episode", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                              DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1")  # fmt: skip
        run_cli(network, [str(agent_clis / "claude"), "-p", "Check this folder with Bash.", *tail], env=claude_env,
                cwd=project)  # fmt: skip
        codex_home = tmp_path / "codex_home"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=proxy.url))
        codex_env = base_env(tmp_path / "home2", agent_clis, CODEX_HOME=str(codex_home), LOCAL_KEY=prefix + "cx-ep")
        codex = [str(agent_clis / "codex"), "exec", "--skip-git-repo-check", "--json", "-m", "qwen3"]
        run_cli(network, [*codex, "Check this folder with the shell."], env=codex_env, cwd=project)
        served = len(replica.received())

        out = tmp_path / "claude-rollouts.parquet"
        driver = [
            sys.executable, str(REPO / "examples" / "rollout_driver.py"), "--proxy", proxy.url, "--token", token,
            "--agent", "claude-code", "--claude", str(agent_clis / "claude"), "--key-prefix", prefix,
            "--tasks", "1", "--samples", "2", "--concurrency", "2", "--prefix", "cc-driven", "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "PATH": base_env(tmp_path / "h3", agent_clis)["PATH"]}
        result = subprocess.run(network.command(driver), env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    headers = replica.backend.received_headers
    keys = [{k.lower(): v for k, v in h.items() if k.lower() in ("authorization", "x-api-key")} for h in headers]
    # Claude Code's x-api-key and Codex's bearer alike: the backend's key as `Authorization: Bearer`, nothing else.
    assert keys == [{"authorization": f"Bearer {backend_key}"}] * len(replica.received()), keys
    by_name = {f.turns[0].session_id: f for f in iter_session_files(record_dir)}
    assert sorted(by_name) == ["cc-driven-0000", "cc-driven-0001", "cc-episode", "cx-ep"]
    assert {t.api for t in by_name["cc-episode"].turns} == {"anthropic_messages"}
    assert {t.api for t in by_name["cx-ep"].turns} == {"openai_responses"}
    assert len(by_name["cc-episode"].turns) + len(by_name["cx-ep"].turns) == served
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["session_id"] for r in rows) == ["cc-driven-0000", "cc-driven-0001"]
    assert [(r["group"], r["group_index"]) for r in rows] == [("task-0", 0)] * 2, "one task, one group of two"
    assert all(r["reward"] == 1.0 and "tool_used" in r["labels"] for r in rows), [r["labels"] for r in rows]
    for row in rows:
        recorded = by_name[row["session_id"]]
        assert [c.reason for c in recorded.closes] == ["closed"]
        leaf = recorded.turns[-1]
        prompt, completion = recorded.full_ids()[row["leaf_turn_id"]]
        assert row["input_ids"] == prompt + completion and leaf.session_id == row["session_id"]
