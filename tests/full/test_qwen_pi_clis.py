"""The real Qwen Code and pi CLIs, unmodified, through a real mitmdump to the sglang replica: every turn token exact,
tool round trips through each CLI's own shell tool on one chain of exact ids (pi's second invocation, `-c`, on the
same chain), each episode named by its API key.

Command lines (run from a scratch project directory, HOME a scratch directory, nothing else inherited; the proxy runs
with `tito_session_api_key_prefix=sk-tito-`, so the key `sk-tito-EPISODE` names the episode EPISODE):

    Qwen Code, chat completions (the key goes in `Authorization: Bearer`; HOME/.qwen/settings.json: QWEN_SETTINGS):
    OPENAI_BASE_URL=http://127.0.0.1:PORT/v1 OPENAI_API_KEY=sk-tito-EPISODE OPENAI_MODEL=qwen3
        qwen -p PROMPT --yolo --output-format stream-json
    (`qwen --continue` resumes with a history that lacks the first prompt's date reminder: a new prompt, no extension)

    pi, Anthropic Messages (`x-api-key`) or the Gemini API (`x-goog-api-key`), by the provider's "api" in
    HOME/.pi/agent/models.json (pi_models below; its "apiKey" names the environment variable that holds the key):
    PI_OFFLINE=1 TITO_API_KEY=sk-tito-EPISODE
        pi --provider tito --model qwen3 --mode json -p PROMPT
        pi --provider tito --model qwen3 --mode json -c -p PROMPT2

The stack (the loopback-only namespace, the pinned CLIs, the steered replica) is support/agent_cli_stack.py's. Where the
namespace is refused, the CLIs' own switches keep them home: Qwen Code's usage statistics, telemetry and auto-update
off in its settings, pi's startup network operations (update checks, install telemetry) off with PI_OFFLINE=1.
"""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    COMMAND,
    KEY_PREFIX,
    MARKER,
    TOOL_ROUNDS,
    Network,
    agent_clis,
    assert_backend_saw_only_its_key,
    assert_exact_chain,
    base_env,
    keyed_proxy,
    network,
    run_cli,
    steered_replica,
    text_of,
)
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files

# The full tier, alone on the machine: the real CLIs under their own timeouts.
pytestmark = [pytest.mark.full, pytest.mark.serial]

# Qwen Code runs a turn's calls side by side, and once in a clean-clone run it reported one of two parallel calls of
# the bare command with "Output: (empty)" and exit code 0: a short pause before the command prints keeps its output.
QWEN_COMMAND = f"sleep 0.2; {COMMAND}"
PREFERRED_TOOLS = {
    "run_shell_command": {"command": QWEN_COMMAND},  # Qwen Code
    "bash": {"command": COMMAND},  # pi
}
# Without these Qwen Code reports usage statistics and telemetry to, and checks for updates at, hosts of its own.
QWEN_SETTINGS = {
    "general": {"enableAutoUpdate": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}


def pi_models(api: str, base_url: str) -> dict[str, Any]:
    """pi's models.json: one provider of the given API at the proxy; "apiKey" is resolved as an environment variable
    first, so one file serves every episode. `reasoning`: Qwen3 thinks, and pi echoes its thinking back."""
    model = {"id": "qwen3", "reasoning": True}
    return {"providers": {"tito": {"baseUrl": base_url, "api": api, "apiKey": "TITO_API_KEY", "models": [model]}}}


@pytest.fixture(scope="module")
def replica(network):
    with steered_replica(network, PREFERRED_TOOLS) as running:
        yield running


@pytest.fixture
def proxy(network, replica, tmp_path: Path):
    with keyed_proxy(network, replica, tmp_path) as running:
        yield running


def assert_named(proxy: Mitmdump, replica, episode: str) -> None:
    """Every recorded turn is the episode's; the backend saw only its own key (`assert_backend_saw_only_its_key`)."""
    files = list(iter_session_files(proxy.record_dir))
    assert {t.session_id for f in files for t in f.turns} == {episode}
    assert_backend_saw_only_its_key(proxy, replica, episode)


# ---------------------------------------------------------------------------------------------- tests


def test_qwen_code_cli_is_token_exact(
    network: Network, agent_clis: Path, proxy: Mitmdump, replica, tmp_path: Path
) -> None:
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (home / ".qwen").mkdir(parents=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(QWEN_SETTINGS))
    env = base_env(
        home, agent_clis, OPENAI_BASE_URL=f"{proxy.url}/v1", OPENAI_API_KEY=KEY_PREFIX + "qwen-ep", OPENAI_MODEL="qwen3"
    )
    # One invocation: `--continue` rebuilds the history from Qwen Code's session file without the date
    # <system-reminder> it put in the first prompt, so the resumed request is another prompt, not an extension.
    qwen = [str(agent_clis / "qwen"), "-p", "Check this folder with the shell."]
    run = run_cli(network, [*qwen, "--yolo", "--output-format", "stream-json"], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_chain(proxy, replica, "chat", printed)
    events = run.events()
    result = events[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], str(run)
    blocks = [
        (event["type"], block)
        for event in events
        if event["type"] in ("assistant", "user")
        for block in event["message"]["content"]
        if isinstance(block, dict)
    ]
    uses = [block for kind, block in blocks if kind == "assistant" and block["type"] == "tool_use"]
    outputs = [block for kind, block in blocks if kind == "user" and block["type"] == "tool_result"]
    # One round is the replica's parallel turn (every third turn of the session): two calls.
    assert [u["name"] for u in uses] == ["run_shell_command"] * (TOOL_ROUNDS + 1), str(run)
    assert sorted(o["tool_use_id"] for o in outputs) == sorted(u["id"] for u in uses), outputs
    assert all(printed in text_of(o["content"]) and not o["is_error"] for o in outputs), outputs
    assert [u["id"] for u in uses] == [c["id"] for t in turns for c in t.assistant_message.get("tool_calls") or []]
    assert_named(proxy, replica, "qwen-ep")


@pytest.mark.parametrize(
    ("pi_api", "api", "path"),
    [
        ("anthropic-messages", "anthropic_messages", ""),
        ("google-generative-ai", "gemini", "/v1beta"),
    ],
)
def test_pi_cli_is_token_exact(
    network: Network,
    agent_clis: Path,
    proxy: Mitmdump,
    replica,
    tmp_path: Path,
    pi_api: str,
    api: str,
    path: str,
) -> None:
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    (home / ".pi" / "agent").mkdir(parents=True)
    (home / ".pi" / "agent" / "models.json").write_text(json.dumps(pi_models(pi_api, proxy.url + path)))
    episode = f"pi-{api}"
    env = base_env(home, agent_clis, PI_OFFLINE="1", TITO_API_KEY=KEY_PREFIX + episode)
    pi = [str(agent_clis / "pi"), "--provider", "tito", "--model", "qwen3", "--mode", "json"]
    first = run_cli(network, [*pi, "-p", "Check this folder with the shell."], env=env, cwd=project)
    first_turns = len(replica.generated())
    second = run_cli(network, [*pi, "-c", "-p", "Check it once more."], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_chain(proxy, replica, api, printed, invocations=2)
    sessions, seen = set(), []
    for run in (first, second):
        events = run.events()
        sessions |= {event["id"] for event in events if event["type"] == "session"}
        seen += [event["toolCallId"] for event in events if event["type"] == "tool_execution_start"]
        assert events[-1]["type"] == "agent_end", str(run)
        last = events[-1]["messages"][-1]
        assert last["role"] == "assistant" and last["stopReason"] == "stop", last
        starts = [event for event in events if event["type"] == "tool_execution_start"]
        ends = [event for event in events if event["type"] == "tool_execution_end"]
        # One round per invocation is the replica's parallel turn (every third turn of the session): two calls.
        assert [s["toolName"] for s in starts] == ["bash"] * (TOOL_ROUNDS + 1), str(run)
        assert all(s["args"] == {"command": COMMAND} for s in starts), starts
        assert sorted(e["toolCallId"] for e in ends) == sorted(s["toolCallId"] for s in starts)
        assert all(printed in text_of(e["result"]["content"]) and not e["isError"] for e in ends), ends
    assert len(sessions) == 1  # -c picked up the first invocation's session
    # pi ran each call under the id the proxy gave it (on the Gemini API, echoed without it: see gemini_translation)
    assert seen == [c["id"] for t in turns for c in t.assistant_message.get("tool_calls") or []]
    appended = turns[first_turns].appended_messages
    assert appended[-1]["role"] == "user" and "Check it once more." in text_of(appended[-1]["content"])
    assert_named(proxy, replica, episode)
