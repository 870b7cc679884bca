"""The real opencode CLI, unmodified, through a real mitmdump to the sglang replica, once per provider package it ships:
`@ai-sdk/openai-compatible` (chat completions), `@ai-sdk/anthropic` (Messages), `@ai-sdk/openai` (Responses) and
`@ai-sdk/google` (the Gemini API). Each: a title request, then tool round trips through opencode's own `bash` tool
and the answer, and a second invocation (`--continue`) on the same chain of exact ids; every turn token exact, the
episode named by its API key.

Command line (run from a scratch project directory, HOME a scratch directory, nothing else inherited; the proxy runs
with `tito_session_api_key_prefix=sk-tito-`, so the key `sk-tito-EPISODE` names the episode EPISODE):

    OPENCODE_CONFIG=FILE TITO_API_KEY=sk-tito-EPISODE OPENCODE_DISABLE_MODELS_FETCH=1 \
    OPENCODE_DISABLE_DEFAULT_PLUGINS=1 OPENCODE_DISABLE_AUTOUPDATE=1 \
        opencode run -m tito/qwen3 --format json WORDS OF THE PROMPT
        opencode run -m tito/qwen3 --format json --continue WORDS OF THE NEXT PROMPT

FILE is `opencode_config` below: one provider `tito` of the given npm package at the proxy (`/v1`; `/v1beta` for
`@ai-sdk/google`), its key read from $TITO_API_KEY. The packages send the key as `Authorization: Bearer`
(openai-compatible, openai), `x-api-key` (anthropic) and `x-goog-api-key` (google). The prompt goes as separate
words: opencode joins its arguments, and quotes one that holds a space. opencode also sends `X-Session-Id` (its own
session id) on every request; the episode key's name wins over it.

The stack (the loopback-only namespace, the pinned CLIs, the steered replica) is support/agent_cli_stack.py's. Where the
namespace is refused, the CLI's own switches keep it home: the models fetch from models.dev, the default plugins,
auto-update and sharing off. Those switches leave one thing: opencode installs `@opencode-ai/plugin` into its config
directory from registry.npmjs.org, in the background, unless that directory has a `node_modules/` and a package.json
and package-lock.json that both name it (`stub_plugin_install`; with it the CLI resolves no host name at all).
"""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    BASH_ARGS,
    COMMAND,
    KEY_PREFIX,
    MARKER,
    TOOL_ROUNDS,
    Network,
    agent_clis,
    assert_backend_saw_only_its_key,
    assert_exact_chain,
    base_env,
    chains_of,
    keyed_proxy,
    network,
    opencode_config,
    run_cli,
    steered_replica,
    stub_plugin_install,
    text_of,
)
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import iter_session_files

# The full tier, alone on the machine: the real CLI under its own timeout.
pytestmark = [pytest.mark.full, pytest.mark.serial]

PROMPT = "Check this folder with the shell."
AGAIN = "Check it once more."


@pytest.fixture(scope="module")
def replica(network):
    with steered_replica(network, {"bash": BASH_ARGS}) as running:
        yield running


@pytest.fixture
def proxy(network, replica, tmp_path: Path):
    with keyed_proxy(network, replica, tmp_path) as running:
        yield running


def assert_exact_episode(
    proxy: Mitmdump, replica, api: str, printed: str, episode: str, *, invocations: int = 1
) -> list:
    """The stack's exact chain (`assert_exact_chain`), recorded in the episode's one session beside opencode's title
    request: a root of its own, one turn that answers with text and calls no tool. Returns the main chain's turns."""
    turns = assert_exact_chain(proxy, replica, api, printed, invocations=invocations, side_calls=True)
    files = list(iter_session_files(proxy.record_dir))
    assert len(files) == 1, [f.path.name for f in files]
    (session,) = files
    assert {t.session_id for t in session.turns} == {episode}
    assert {t.api for t in session.turns} == {api}
    sides = [chain for chain in chains_of(session) if chain[0].turn_id != turns[0].turn_id]
    # The title request (once, for the first prompt). Where it falls among the records is left open: opencode forks
    # it off as the session starts, and need not wait for it.
    assert [len(chain) for chain in sides] == [1], [[t.turn_id for t in chain] for chain in sides]
    assert sides[0][0].finish_reason == "stop" and not sides[0][0].assistant_message.get("tool_calls")
    return turns


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    ("npm", "api", "path"),
    [
        ("@ai-sdk/openai-compatible", "chat", "/v1"),
        ("@ai-sdk/anthropic", "anthropic_messages", "/v1"),
        ("@ai-sdk/openai", "openai_responses", "/v1"),
        ("@ai-sdk/google", "gemini", "/v1beta"),
    ],
)
def test_opencode_cli_is_token_exact(
    network: Network,
    agent_clis: Path,
    proxy: Mitmdump,
    replica,
    tmp_path: Path,
    npm: str,
    api: str,
    path: str,
) -> None:
    # The config outside the project's ancestry: opencode also reads any opencode.json above its directory, and the
    # file $OPENCODE_CONFIG names is to be the only one.
    project, config = tmp_path / "work" / "project", tmp_path / "config" / "opencode.json"
    project.mkdir(parents=True)
    config.parent.mkdir()
    config.write_text(json.dumps(opencode_config(npm, proxy.url + path)))
    episode = f"opencode-{api}"
    stub_plugin_install(tmp_path / "home")
    env = base_env(
        tmp_path / "home",
        agent_clis,
        OPENCODE_CONFIG=str(config),
        TITO_API_KEY=KEY_PREFIX + episode,
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_AUTOUPDATE="1",
    )
    opencode = [str(agent_clis / "opencode"), "run", "-m", "tito/qwen3", "--format", "json"]
    first = run_cli(network, [*opencode, *PROMPT.split()], env=env, cwd=project)
    first_turns = len(replica.generated())
    second = run_cli(network, [*opencode, "--continue", *AGAIN.split()], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_exact_episode(proxy, replica, api, printed, episode, invocations=2)
    assert_backend_saw_only_its_key(proxy, replica, episode)
    # Each prompt reached the model as typed (the words joined, no quotes added); the second was appended to the
    # stored history (the first turn of the episode is the title request).
    for turn, prompt in ((turns[0], PROMPT), (turns[first_turns - 1], AGAIN)):
        last = turn.appended_messages[-1]
        assert last["role"] == "user" and text_of(last["content"]) == prompt, last
    sessions = set()
    calls = [c["id"] for t in turns for c in t.assistant_message.get("tool_calls") or []]
    uses = []
    for run in (first, second):
        # What opencode saw: every bash call ran in the namespace and printed the marker; the last step ended it.
        events = run.events()
        sessions |= {event["sessionID"] for event in events}
        ran = [event["part"] for event in events if event["type"] == "tool_use"]
        # One round per invocation is the replica's parallel turn (every third turn of the session): two calls.
        assert [u["tool"] for u in ran] == ["bash"] * (TOOL_ROUNDS + 1), str(run)
        assert all(u["state"]["status"] == "completed" and u["state"]["input"] == BASH_ARGS for u in ran), ran
        assert all(printed in u["state"]["output"] and u["state"]["metadata"]["exit"] == 0 for u in ran), ran
        steps = [event["part"]["reason"] for event in events if event["type"] == "step_finish"]
        assert steps == ["tool-calls"] * TOOL_ROUNDS + ["stop"], steps
        uses += ran
    if api == "gemini":
        # @ai-sdk/google reads no call id off the wire (the Gemini API long had none): it makes up its own, and
        # echoes the calls and their responses without ids (the proxy names them back by its thought signature).
        assert len(uses) == len(calls)
    else:
        assert sorted(u["callID"] for u in uses) == sorted(calls)  # the ids the proxy answered with
    # --continue picked up the first invocation's session. opencode named it itself on every request
    # (`x-session-affinity` passes to the backend; its `X-Session-Id`, the proxy's session header, does not), and the
    # episode's key named the recording all the same.
    (own_session,) = sessions
    affinity = [v for h in replica.backend.received_headers for k, v in h.items() if k.lower() == "x-session-affinity"]
    assert affinity == [own_session] * len(replica.received()) and own_session != episode
