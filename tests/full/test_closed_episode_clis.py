"""The real CLIs stop at once on an episode their driver closed: Claude Code, Codex, Gemini CLI and opencode each run
a short episode (one tool round, then the answer), the driver closes it through the control API, and the same CLI run
again naming that episode gets the proxy's final refusal (410 with `x-should-retry: false`; on the Responses API,
Codex's, a 400 with the code `session_closed`), sends it once and exits within seconds, printing the proxy's reason. A
409 here had Claude Code retrying for six minutes.

Each CLI names its episode by API key (`sk-tito-EPISODE`, the proxy's `tito_session_api_key_prefix`), as in
full/test_agent_clis.py, test_gemini_cli.py and test_opencode_cli.py, whose command lines these are; the stack (the
loopback-only namespace, the pinned CLIs, the steered replica) is support/agent_cli_stack.py's. The control API runs
inside the namespace, where the proxy is."""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    BACKEND_KEY,
    BASH_ARGS,
    CODEX_CONFIG,
    COMMAND,
    GEMINI_SETTINGS,
    KEY_PREFIX,
    NamespacedReplica,
    Network,
    agent_clis,
    base_env,
    namespaced_proxy,
    network,
    opencode_config,
    run_cli,
    stub_plugin_install,
)
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import read_session
from tito_addon.replicas.sglang_replica import ReplicaConfig

# The full tier, alone on the machine: the real CLIs under their own timeouts, and a bound on time.
pytestmark = [pytest.mark.full, pytest.mark.serial]

TOKEN = "closed-cli-control-token-0123456789"
REASON = "was closed by its driver"
# Generous, yet far below any retry schedule: Claude Code's backs off for minutes, the SDKs' for seconds each try.
EXIT_BOUND_S = 30
# Each CLI's shell tool, all in one replica (the first one a request offers is called).
PREFERRED_TOOLS = {
    "Bash": {"command": COMMAND, "description": "Print a marker"},  # Claude Code
    "exec_command": {"cmd": COMMAND},  # Codex
    "run_shell_command": {"command": COMMAND},  # Gemini CLI
    "bash": BASH_ARGS,  # opencode
}
FIRST, AGAIN = "Check this folder with the shell.", "Check it once more."
# The answers a run naming the closed episode gets (measured with the pinned CLIs). Claude Code, Codex and Gemini CLI:
# its prompt, once. opencode: its title request and its prompt, once each (its error says `isRetryable: false`). Codex
# 0.171.0 retries its turn on any status it maps to `UnexpectedStatus` (all but 400, 401, 429 and 5xx: core's
# `api_bridge::map_api_error` and `CodexErr::is_retryable`) `stream_max_retries` (5) times, whatever `x-should-retry`
# says: answered 410 it sent six requests in about 7 s; so the Responses API answers a final refusal 400.
ANSWERS = {"claude": ["410"], "codex": ["400"], "gemini": ["410"], "opencode": ["410", "410"]}


@pytest.fixture(scope="module")
def replica(network):
    # One tool round per prompt: the episode only has to exist before it is closed.
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), preferred_tools=PREFERRED_TOOLS, tool_rounds=1)
    with NamespacedReplica(config, network) as running:
        yield running


@pytest.fixture
def proxy(network, replica, tmp_path: Path):
    with namespaced_proxy(network, replica, tmp_path, tito_session_api_key_prefix=KEY_PREFIX,
                          tito_backend_api_key=BACKEND_KEY, tito_control_token=TOKEN) as running:  # fmt: skip
        yield running


# ---------------------------------------------------------------------------------------------- each CLI


def claude(bin_dir: Path, tmp_path: Path, proxy: Mitmdump, key: str) -> tuple[Callable[[str], list[str]], dict]:
    env = base_env(tmp_path / "home", bin_dir, ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY=key,
                   CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
                   DISABLE_AUTOUPDATER="1")  # fmt: skip
    tail = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
    return lambda prompt: [str(bin_dir / "claude"), "-p", prompt, *tail], env


def codex(bin_dir: Path, tmp_path: Path, proxy: Mitmdump, key: str) -> tuple[Callable[[str], list[str]], dict]:
    codex_home = tmp_path / "codex_home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=proxy.url))
    env = base_env(tmp_path / "home", bin_dir, CODEX_HOME=str(codex_home), LOCAL_KEY=key)
    argv = [str(bin_dir / "codex"), "exec", "--skip-git-repo-check", "--json", "-m", "qwen3"]
    return lambda prompt: [*argv, prompt], env


def gemini(bin_dir: Path, tmp_path: Path, proxy: Mitmdump, key: str) -> tuple[Callable[[str], list[str]], dict]:
    home = tmp_path / "home"
    (home / ".gemini").mkdir(parents=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(GEMINI_SETTINGS))
    env = base_env(home, bin_dir, GOOGLE_GEMINI_BASE_URL=proxy.url, GEMINI_API_KEY=key, GEMINI_SANDBOX="false",
                   GEMINI_CLI_TRUST_WORKSPACE="true")  # fmt: skip
    tail = ["-m", "qwen3", "--approval-mode", "yolo", "--output-format", "stream-json"]
    return lambda prompt: [str(bin_dir / "gemini"), "-p", prompt, *tail], env


def opencode(bin_dir: Path, tmp_path: Path, proxy: Mitmdump, key: str) -> tuple[Callable[[str], list[str]], dict]:
    # The config outside the project's ancestry (opencode reads any opencode.json above its directory too).
    config = tmp_path / "config" / "opencode.json"
    config.parent.mkdir()
    config.write_text(json.dumps(opencode_config("@ai-sdk/openai-compatible", proxy.url + "/v1")))
    stub_plugin_install(tmp_path / "home")
    env = base_env(tmp_path / "home", bin_dir, OPENCODE_CONFIG=str(config), TITO_API_KEY=key,
                   OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
                   OPENCODE_DISABLE_AUTOUPDATE="1")  # fmt: skip
    argv = [str(bin_dir / "opencode"), "run", "-m", "tito/qwen3", "--format", "json"]
    return lambda prompt: [*argv, *prompt.split()], env  # the prompt as words: opencode quotes one with a space


def close_episode(network: Network, proxy: Mitmdump, episode: str) -> dict:
    """The driver's close, from inside the namespace (where the proxy listens)."""
    script = (
        "import json, sys\nfrom tito_addon.client import TitoClient\n"
        "with TitoClient(sys.argv[1], sys.argv[2]) as tito:\n    print(json.dumps(tito.close(sys.argv[3])))"
    )
    argv = network.command([sys.executable, "-c", script, proxy.url, TOKEN, episode])
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr[-3000:]
    return json.loads(shown.stdout)


def answered(proxy: Mitmdump) -> list[str]:
    """The statuses of the flows mitmdump answered so far, from its own log (one `<< STATUS` line per flow)."""
    return re.findall(r"<< (\d{3})\b", proxy.output())


# ---------------------------------------------------------------------------------------------- the test


@pytest.mark.parametrize("cli", [claude, codex, gemini, opencode], ids=lambda cli: cli.__name__)
def test_a_cli_naming_a_closed_episode_exits_at_once(
    network: Network, agent_clis: Path, proxy: Mitmdump, replica, tmp_path: Path, cli, record_property
) -> None:
    episode = f"closed-{cli.__name__}"
    project = tmp_path / "project"
    project.mkdir()
    argv, env = cli(agent_clis, tmp_path, proxy, KEY_PREFIX + episode)
    run_cli(network, argv(FIRST), env=env, cwd=project)
    session = read_session(proxy.record_dir, episode)
    assert session is not None and session.turns, "the first run recorded the episode"
    turns = len(session.turns)
    assert not [s for s in answered(proxy) if s != "200"], proxy.output()[-4000:]
    closed = close_episode(network, proxy, episode)
    assert closed == {"session_id": episode, "closed": True, "turns": turns, "already_closed": False}

    before, served = len(answered(proxy)), len(replica.received())
    started = time.monotonic()
    again = run_cli(network, argv(AGAIN), env=env, cwd=project, ok=tuple(range(-64, 256)))
    took = time.monotonic() - started
    time.sleep(0.5)  # the log's own lag: every request of the CLI was answered before it exited
    refused = answered(proxy)[before:]
    record_property("exit_s", round(took, 2))
    record_property("requests", refused)
    record_property("returncode", again.returncode)
    print(f"{cli.__name__}: exit {again.returncode} after {took:.1f}s, the proxy answered {refused}")
    assert took < EXIT_BOUND_S, (took, refused, str(again))
    # Every request of the run was refused, and sent once.
    assert refused == ANSWERS[cli.__name__], (refused, str(again))
    assert REASON in again.stdout + again.stderr, str(again)
    assert again.returncode != 0, str(again)
    # Nothing forwarded, nothing recorded, the close still the episode's last word.
    assert len(replica.received()) == served
    after = read_session(proxy.record_dir, episode)
    assert after is not None and len(after.turns) == turns and [c.reason for c in after.closes] == ["closed"]
