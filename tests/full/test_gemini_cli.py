"""The real Gemini CLI, unmodified, through a real mitmdump to the sglang replica: every turn token exact, tool round
trips through its own shell tool and a resumed session (`--resume latest`) on one chain of exact ids.

Command lines (run from a scratch project directory, HOME a scratch directory, nothing else inherited):

    GOOGLE_GEMINI_BASE_URL=http://127.0.0.1:PORT GEMINI_API_KEY=KEY GEMINI_SANDBOX=false \
    GEMINI_CLI_TRUST_WORKSPACE=true (HOME/.gemini/settings.json: GEMINI_SETTINGS)
        gemini -p PROMPT -m qwen3 --approval-mode yolo --output-format stream-json
        gemini -p PROMPT2 --resume latest -m qwen3 --approval-mode yolo --output-format stream-json

`security.auth.selectedType` must be pinned (with a base URL set, headless Gemini CLI otherwise infers an auth type it
then rejects: exit 41); without folder trust it downgrades yolo and sends nothing (exit 55). `-m` bypasses its model
router. The key arrives as `x-goog-api-key`, so `GEMINI_API_KEY=sk-tito-EPISODE` names the episode where the proxy
has `tito_session_api_key_prefix=sk-tito-`.

On the wire (0.61.0): the main thread only, `:streamGenerateContent?alt=sse` under the `-m` name; the ids and the
signatures of the reply come back as they went out. A resumed session rebuilds its history from the CLI's session
file: the signatures are lost (the placeholder `skip_thought_signature_validator` stands on the first call of each
model content), each text comes back trimmed, and every function response twice in its content. The proxy shows texts
trimmed and reads an exact repeat of a response as nothing (`gemini_translation`), so the resumed session extends the
first invocation's chain.

The shell command is the stack's COMMAND, a pipe: Gemini CLI refuses command substitution (`$(…)`: "Blocked: command
substitution detected in shell command", reported with status `success`).
"""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    COMMAND,
    GEMINI_SETTINGS,
    KEY_PREFIX,
    MARKER,
    TOOL_ROUNDS,
    CliRun,
    Network,
    agent_clis,
    assert_backend_saw_only_its_key,
    assert_exact_chain,
    base_env,
    keyed_proxy,
    namespaced_proxy,
    network,
    run_cli,
    steered_replica,
    text_of,
)
from support.basics import API_KEYS
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files

# The full tier, alone on the machine: the real CLIs (an 800 MB npm install the first time) under their own timeouts.
pytestmark = [pytest.mark.full, pytest.mark.serial]

PREFERRED_TOOLS = {"run_shell_command": {"command": COMMAND}}
API_KEY = API_KEYS[0]  # one the session-wide audit looks for in every proxy log and recording
FIRST, SECOND = "Check this folder with the shell.", "Check it once more."
# The notes of a response a resumed session repeated (`ContentsTranslation.user`).
REPEATED = "a functionResponse repeating an earlier one of this content exactly (left out)"


@pytest.fixture(scope="module")
def replica(network):
    with steered_replica(network, PREFERRED_TOOLS) as running:
        yield running


def gemini_env(tmp_path: Path, bin_dir: Path, proxy: Mitmdump, key: str) -> dict[str, str]:
    home = tmp_path / "home"
    (home / ".gemini").mkdir(parents=True)
    (home / ".gemini" / "settings.json").write_text(json.dumps(GEMINI_SETTINGS))
    return base_env(home, bin_dir, GOOGLE_GEMINI_BASE_URL=proxy.url, GEMINI_API_KEY=key, GEMINI_SANDBOX="false",
                    GEMINI_CLI_TRUST_WORKSPACE="true")  # fmt: skip


def run_session(network: Network, bin_dir: Path, env: dict[str, str], project: Path, output: str) -> list[CliRun]:
    """A prompt, then another in the same session resumed."""
    tail = ["-m", "qwen3", "--approval-mode", "yolo", "--output-format", output]
    gemini = str(bin_dir / "gemini")
    first = run_cli(network, [gemini, "-p", FIRST, *tail], env=env, cwd=project)
    second = run_cli(network, [gemini, "-p", SECOND, "--resume", "latest", *tail], env=env, cwd=project)
    return [first, second]


def assert_resumed(turns: list, first_turns: int) -> None:
    """The second invocation's first turn: the new prompt appended to the history, each function response the resumed
    session repeated read once (noted), the models as asked."""
    resumed = turns[first_turns]
    appended = resumed.appended_messages
    assert [m["role"] for m in appended] == ["user"] and SECOND in text_of(appended[0]["content"]), appended
    results = sum(1 for t in turns[:first_turns] for m in t.appended_messages or [] if m["role"] == "tool")
    assert results == TOOL_ROUNDS + 1  # one round is the replica's parallel turn: two calls
    assert [note.partition(": ")[2] for note in resumed.left_out or []] == [REPEATED] * results, resumed.left_out
    assert {t.model for t in turns} == {"qwen3"}


# ---------------------------------------------------------------------------------------------- tests


def test_gemini_cli_is_token_exact(network: Network, agent_clis: Path, replica, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    with namespaced_proxy(network, replica, tmp_path) as proxy:
        env = gemini_env(tmp_path, agent_clis, proxy, API_KEY)
        first, second = run_session(network, agent_clis, env, project, "stream-json")

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_chain(proxy, replica, "gemini", printed, invocations=2)
    assert len(turns) == len(replica.received())  # every request the CLI sent was a turn of the main chain
    assert_resumed(turns, TOOL_ROUNDS + 1)
    # What the CLI saw: each invocation ran its shell tool in the namespace and ended successfully, in one session.
    sessions = set()
    for run in (first, second):
        events = run.events()
        sessions |= {event["session_id"] for event in events if event["type"] == "init"}
        uses = [event for event in events if event["type"] == "tool_use"]
        outputs = [event for event in events if event["type"] == "tool_result"]
        assert [(u["tool_name"], u["parameters"]) for u in uses] == [("run_shell_command", {"command": COMMAND})] * (
            TOOL_ROUNDS + 1
        ), str(run)
        assert sorted(o["tool_id"] for o in outputs) == sorted(u["tool_id"] for u in uses), str(run)
        assert all(o["status"] == "success" and o["output"] == printed for o in outputs), outputs
        result = events[-1]
        assert result["type"] == "result" and result["status"] == "success", str(run)
        assert result["stats"]["tool_calls"] == TOOL_ROUNDS + 1, result
    assert len(sessions) == 1  # `--resume latest` picked up the first invocation's session


def test_gemini_api_key_names_the_episode(network: Network, agent_clis: Path, replica, tmp_path: Path) -> None:
    """`GEMINI_API_KEY=sk-tito-EPISODE` names the episode (it arrives as `x-goog-api-key`), both invocations in it;
    the backend sees only its own key, and the episode's key is in no log or recording. The JSON output format."""
    key = KEY_PREFIX + "gemini-episode"
    project = tmp_path / "project"
    project.mkdir()
    with keyed_proxy(network, replica, tmp_path) as proxy:
        env = gemini_env(tmp_path, agent_clis, proxy, key)
        runs = run_session(network, agent_clis, env, project, "json")

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_chain(proxy, replica, "gemini", printed, invocations=2)
    assert_resumed(turns, TOOL_ROUNDS + 1)
    assert {t.session_id for t in turns} == {"gemini-episode"}
    # The CLI put its key in `x-goog-api-key`; the backend got its own as `Authorization: Bearer`, on every request.
    assert_backend_saw_only_its_key(proxy, replica, "gemini-episode")
    sessions = set()
    answers = [t.assistant_message["content"] for t in turns if t.finish_reason == "stop"]
    for run, answer in zip(runs, answers, strict=True):
        shown = json.loads(run.stdout)
        sessions.add(shown["session_id"])
        # The answer the CLI printed is the committed one (shown trimmed), which the resumed session echoed back.
        assert shown["response"] == answer and "error" not in shown, str(run)
        tools = shown["stats"]["tools"]
        assert tools["totalCalls"] == tools["totalSuccess"] == TOOL_ROUNDS + 1 and tools["totalFail"] == 0, tools
    assert len(sessions) == 1
    assert [f.path.name for f in iter_session_files(proxy.record_dir)] == ["gemini-episode.jsonl"]
