"""The real Claude Code CLI, unmodified, through weight updates: while it runs its tool rounds through a real mitmdump
to the sglang replica, a trainer pauses the engine in abort mode whenever a generation is under way, relabels the
weights and resumes (../shared/docs/weight-updates.md §1). Claude Code streams every turn, so each cut falls in a
streamed Anthropic Messages turn: the agent must see no error and no cut answer, its tools must run as if nothing
happened, and every recorded turn must be the exact chain of engine requests that generated it.

The stack (the loopback-only namespace, the pinned CLI, the steered replica) is support/agent_cli_stack.py's; the
replica lives in the namespace, so the trainer acts on its engine from the replica's own loop, not over HTTP.
"""

# ruff: noqa: F811 - the stack's fixtures are imported by name and taken as arguments
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    COMMAND,
    MARKER,
    TOOL_ROUNDS,
    Network,
    agent_clis,
    base_env,
    namespaced_proxy,
    network,
    run_cli,
    steered_replica,
    text_of,
)
from support.basics import API_KEYS

from tito_addon.records.record_reader import iter_session_files

pytestmark = [pytest.mark.full, pytest.mark.serial]

UPDATES = 4


def trainer(replica, done: threading.Event, updates: list[str]) -> None:
    """Whenever a generation has sampled 8 tokens: an abort-mode pause, a new label, the resume; UPDATES times."""

    async def resume() -> None:
        replica.backend.pause.resume()

    while not done.is_set() and len(updates) < UPDATES:
        if any(len(g.labels) >= 8 for g in list(replica.backend.pause.in_flight.values())):
            replica.on_loop(replica.backend.pause.pause("abort"))
            updates.append(f"step-{len(updates) + 1}")
            replica.backend.config.weight_version = updates[-1]
            time.sleep(0.1)  # the weights load meanwhile; the resubmitted request waits in the engine's queue
            replica.on_loop(resume())
            time.sleep(0.3)
        time.sleep(0.002)


def test_claude_code_runs_through_weight_updates(network: Network, agent_clis: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    preferred = {"Bash": {"command": COMMAND, "description": "Print a marker"}}
    with (
        steered_replica(network, preferred, token_delay_s=0.004, answer_sentences=2) as replica,
        namespaced_proxy(network, replica, tmp_path) as proxy,
    ):
        env = base_env(
            tmp_path / "home", agent_clis, ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY=API_KEYS[0],
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1",
        )  # fmt: skip
        done, updates = threading.Event(), []
        pushing = threading.Thread(target=trainer, args=(replica, done, updates))
        pushing.start()
        try:
            tail = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
            run = run_cli(network, [str(agent_clis / "claude"), "-p", "Check this folder with Bash.", *tail],
                          env=env, cwd=project)  # fmt: skip
        finally:
            done.set()
            pushing.join(30)
        generated = replica.generated()
        output = proxy.output()

    # What the CLI saw: success, and every Bash call ran in the namespace and printed its marker.
    events = run.events()
    assert events[-1]["type"] == "result" and events[-1]["subtype"] == "success", str(run)
    uses = [b for e in events if e["type"] == "assistant" for b in e["message"]["content"] if b["type"] == "tool_use"]
    outputs = [b for e in events if e["type"] == "user" for b in e["message"]["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]  # fmt: skip
    assert [u["name"] for u in uses] == ["Bash"] * (TOOL_ROUNDS + 1), str(run)
    assert len(outputs) == len(uses) and all(MARKER in text_of(o["content"]) for o in outputs), outputs
    assert not any(o.get("is_error") for o in outputs), outputs
    assert not re.findall(r"<< ([45]\d\d\b.*)", output), output[-6000:]
    assert updates, "no generation was under way long enough to cut"

    # Every recorded turn is the chain of engine requests that generated it: the first on its prompt, each next on
    # the prompt and everything before; its per-token versions are the engine's labels, except those of the streamed
    # first request, which sglang's chat stream does not report (recorded as none, never made up).
    by_prompt = {tuple(g["prompt_ids"]): g for g in generated}
    sessions = list(iter_session_files(proxy.record_dir))
    resumed = 0
    for session in sessions:
        ids = session.full_ids()
        for turn in session.turns:
            prompt, completion = ids[turn.turn_id]
            chain, sampled, labels = [], [], []
            while len(sampled) < len(completion):
                step = by_prompt[tuple(prompt + sampled)]
                sampled += step["completion_ids"]
                labels += step["labels"]
                chain.append(step)
            assert sampled == completion and turn.api == "anthropic_messages"
            assert (turn.resumed.attempts if turn.resumed else 1) == len(chain)
            first = len(chain[0]["completion_ids"])
            versions = turn.token_weight_versions()
            assert versions[:first] == [None] * first and versions[first:] == labels[first:]
            resumed += len(chain) > 1
    assert resumed >= 1, (updates, [len(s.turns) for s in sessions])
    print(f"\n{sum(len(s.turns) for s in sessions)} turns, {resumed} resumed across {len(updates)} updates")
