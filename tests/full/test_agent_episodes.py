"""Long episodes of the real Claude Code and Codex, unmodified, through a real mitmdump to the sglang replica: tens of
tool round trips, automatic compactions forced by the CLIs' own window settings and tool output large enough to fill
it, an explicit compaction and a sub-agent; and Gemini CLI's own chat compression, twice, across resumed runs. Every
request answered 200, every turn token exact against what the replica received and generated, every segment linked
into one episode (`episode`, `call`, `follows`), and the exported rows, one per segment, equal the replica's ids with
the episode's reward on each.

The stack (a loopback-only network namespace, the pinned CLIs, the replica inside the namespace) is
tests/support/agent_cli_stack.py's; what the CLIs send in these episodes is measured in the README's "Episodes".
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.agent_cli_stack import (  # noqa: F401 - fixtures
    CODEX_CONFIG,
    HostLoopback,
    NamespacedReplica,
    agent_clis,
    base_env,
    network,
    run_cli,
    text_of,
)
from support.basics import tokenizer_path
from support.gemini_agent import COMPRESSION_MODEL
from support.proxy_harness import REPO
from support.token_exact import assert_token_exact

from tito_addon.records.record_models import AnnotationRecord
from tito_addon.records.record_reader import iter_session_files
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.replicas.proxy_process import Mitmdump
from tito_addon.replicas.sglang_replica import ReplicaConfig

pytestmark = [pytest.mark.full, pytest.mark.serial]

# ~2.8k Qwen3 tokens a round: Claude Code's window (100000, the least it takes) fills in ~16 rounds.
NUMBERS = "seq 100000 100400; echo tito-ok $(readlink /proc/self/ns/net)"
KEY_PREFIX = "sk-tito-"
SERVED = "a compaction this proxy served (compaction_trigger)"
CONTEXT = 150_000  # past Claude Code's window (100000), short of its prompt + max_tokens (128000)
SUBAGENT = {
    "description": "Print a marker",
    "prompt": "Run the marker command with Bash and report what it printed.",
    "subagent_type": "Explore",  # its tools hold no Agent: one sub-agent, not a nest of them
    "run_in_background": False,
}


@pytest.fixture(scope="module")
def replica(network):  # noqa: F811
    # A context as large as the CLIs' windows need; Claude Code's max_tokens (128000) is cut to what it leaves.
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), context_length=CONTEXT)
    with NamespacedReplica(config, network) as running:
        yield running


def fresh(replica) -> None:
    """The module's replica as a test finds it: its log empty, its script steered by no earlier test."""
    replica.backend.reset()
    defaults = ReplicaConfig.model_fields
    for knob in ("preferred_tools", "tool_rounds", "tool_budget", "summary_markers", "summary_text"):
        field = defaults[knob]
        value = field.default_factory() if field.default_factory is not None else field.default
        setattr(replica.backend.config, knob, value)


def episode_proxy(network, replica, tmp_path: Path) -> Mitmdump:  # noqa: F811
    """A fresh replica, and a proxy in the namespace whose API keys name episodes, recording to tmp_path/rec; the CLIs
    work in tmp_path/project."""
    fresh(replica)
    (tmp_path / "project").mkdir()
    options = {"tito_session_api_key_prefix": KEY_PREFIX}
    return Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path,
                    launcher=network.command([]), options=options)  # fmt: skip


def steer(replica, tools: dict, rounds: int) -> None:
    replica.backend.config.preferred_tools = tools
    replica.backend.config.tool_rounds = rounds


def shown(record_dir: Path) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "show", str(record_dir), "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in result.stdout.splitlines()]


def assert_linked_episode(
    record_dir: Path, episode: str, agent: str, root_compactions: bool = False
) -> tuple[list, list[dict]]:
    """One session, the episode's name on every turn; every root but the first follows a compaction's summary
    turn or the tool call that spawned it; every compaction turn's reason names the agent. `root_compactions`: the
    agent's compaction requests are roots of their own (Gemini CLI's run under a system instruction of their own),
    not branches of a main turn: in the episode by its name, a first compaction's following nothing, a later one's
    the summary turn their history starts from."""
    (session_file,) = list(iter_session_files(record_dir))
    turns = {t.turn_id: t for t in session_file.turns}
    rows = shown(record_dir)
    assert {row["episode"] for row in rows} == {episode} and [r["turn_id"] for r in rows] == list(turns)
    roots = [t for t in session_file.turns if t.parent_turn_id is None]
    assert roots[0].call == "main" and roots[0].follows is None
    for root in roots[1:]:
        if root_compactions and root.call == "compaction":
            # The first compaction's requests hold no summary; a later one's hold the summary it continued from.
            assert root.follows is None or (root.follows.how == "summary" and turns[root.follows.turn_id].call
                                            == "compaction"), root  # fmt: skip
            continue
        assert root.follows is not None and root.follows.session == episode, root
        followed = turns[root.follows.turn_id]
        if root.follows.how in ("summary", "compaction_item"):
            assert root.call == "main" and followed.call == "compaction"
            assert followed.ts < root.ts
        else:
            assert root.follows.how == "tool_argument" and root.call == "subagent"
            ids = [call["id"] for call in followed.assistant_message.get("tool_calls") or []]
            assert root.follows.tool_call_id in ids
    for turn in session_file.turns:
        if turn.call == "compaction":
            assert turn.call_reason in (f"{agent}'s compaction instruction", SERVED)
            if root_compactions and turn.parent_turn_id is None:
                continue
            assert turn.parent_turn_id is not None and turns[turn.parent_turn_id].call == "main"
    return session_file.turns, rows


def tool_round_trips(turns: list) -> int:
    """Tool results the agent sent back for recorded tool calls."""
    calls = {c["id"] for t in turns for c in t.assistant_message.get("tool_calls") or []}
    answered = {m["tool_call_id"] for t in turns for m in t.appended_messages or [] if m.get("role") == "tool"}
    return len(calls & answered)


def assert_rows_per_segment(record_dir: Path, tmp_path: Path, replica, episode: str, turns: list) -> list[dict]:
    """The episode's reward, given once, is on every row; each row is a segment whose ids are the replica's."""
    TrajectoryRecorder(record_dir).write_annotation(AnnotationRecord(session_id=episode, reward=1.0, ts=1e10))
    out = tmp_path / "rows.jsonl"
    subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), "--to", "jsonl"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    generated: dict[tuple[int, ...], list[list[int]]] = {}  # a prompt sent twice may be answered twice
    for g in replica.generated():
        generated.setdefault(tuple(g["prompt_ids"]), []).append(g["completion_ids"])
    by_id = {t.turn_id: t for t in turns}
    assert [r["segment"] for r in rows] == list(range(len(rows)))
    for row in rows:
        assert row["episode"] == episode and row["reward"] == 1.0
        leaf = by_id[row["leaf_turn_id"]]
        prompt = row["input_ids"][: leaf.prompt_len]
        assert row["input_ids"][leaf.prompt_len :] in generated[tuple(prompt)]
        assert {by_id[t].call for t in row["turn_ids"]} == {row["call"]}
    # Every turn is in exactly one row's segment.
    assert sorted(t for r in rows for t in r["turn_ids"]) == sorted(by_id)
    return rows


def test_a_long_claude_code_episode_is_one_linked_episode(network, agent_clis, replica, tmp_path: Path) -> None:  # noqa: F811
    """44 turns of Bash printing numbers with Claude Code's window at 100000 (two automatic compactions), then
    `/compact`, then a sub-agent (Explore, in the foreground), the episode named by the API key."""
    record_dir, project = tmp_path / "rec", tmp_path / "project"
    with episode_proxy(network, replica, tmp_path) as proxy:
        env = base_env(
            tmp_path / "home", agent_clis, ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY=KEY_PREFIX + "cc-long",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1", CLAUDE_CODE_AUTO_COMPACT_WINDOW="100000",
        )  # fmt: skip
        claude = str(agent_clis / "claude")
        tail = ["--output-format", "stream-json", "--verbose"]
        steer(replica, {"Bash": {"command": NUMBERS, "description": "Print numbers"}}, 60)
        # The script would go on for ever (each new context restarts its rounds): --max-turns ends it, exit 1.
        long = run_cli(network, [claude, "-p", "Print the numbers with Bash, again and again.", "--allowedTools",
                                 "Bash", "--max-turns", "44", *tail], env=env, cwd=project, ok=(0, 1))  # fmt: skip
        assert long.events()[-1].get("subtype") in ("success", "error_max_turns"), str(long)
        compacted = run_cli(network, [claude, "-p", "--continue", "/compact", *tail], env=env, cwd=project)
        assert any(e.get("compact_result") == "success" for e in compacted.events()) or "Compacted" in compacted.stdout
        steer(replica, {"Agent": SUBAGENT, "Bash": {"command": NUMBERS, "description": "Print numbers"}}, 1)
        delegated = run_cli(network, [claude, "-p", "--continue", "Delegate the marker check to a sub-agent.",
                                      "--allowedTools", "Bash", "Agent", *tail], env=env, cwd=project)  # fmt: skip
        assert delegated.events()[-1]["subtype"] == "success", str(delegated)
        refused = re.findall(r"<< ([45]\d\d\b.*)", proxy.output())
        assert not refused, (refused, proxy.output()[-6000:])

    turns = assert_token_exact(record_dir, replica)
    turns, _ = assert_linked_episode(record_dir, "cc-long", "Claude Code")
    calls = [t.call for t in turns]
    assert calls.count("compaction") >= 3 and "subagent" in calls, calls
    summaries = [t for t in turns if t.follows is not None and t.follows.how == "summary"]
    assert len(summaries) >= 3  # two automatic compactions and /compact, each continued from its summary
    assert tool_round_trips(turns) >= 40
    # Claude Code asks 128000 completion tokens: cut to what the context leaves where that is less, and said so.
    for turn in turns:
        if turn.prompt_len + 128000 >= CONTEXT:
            assert turn.completion_budget.model_dump() == {
                "asked": 128000, "sent": CONTEXT - turn.prompt_len - 1, "context_length": CONTEXT
            }  # fmt: skip
        else:
            assert turn.completion_budget is None
    assert sum(t.completion_budget is not None for t in turns) > len(turns) // 2
    rows = assert_rows_per_segment(record_dir, tmp_path, replica, "cc-long", turns)
    assert {r["call"] for r in rows} == {"main", "compaction", "subagent"}


def codex_config(base_url: str, window: str) -> str:
    """Codex's config with its context window settings (before any table, as TOML needs them)."""
    return window + CODEX_CONFIG.format(base_url=base_url)


def test_a_long_codex_episode_is_one_linked_episode(network, agent_clis, replica, tmp_path: Path) -> None:  # noqa: F811
    """44 rounds of exec_command with Codex's window at 40000 and its compaction limit at 20000 (local compactions),
    then a sub-agent it spawns and waits for, the episode named by the provider's key."""
    record_dir, project = tmp_path / "rec", tmp_path / "project"
    with episode_proxy(network, replica, tmp_path) as proxy:
        codex_home = tmp_path / "codex_home"
        codex_home.mkdir()
        window = "model_context_window = 40000\nmodel_auto_compact_token_limit = 20000\n"
        (codex_home / "config.toml").write_text(codex_config(proxy.url, window))
        env = base_env(tmp_path / "home", agent_clis, CODEX_HOME=str(codex_home), LOCAL_KEY=KEY_PREFIX + "cx-long")
        codex = [str(agent_clis / "codex"), "exec", "--skip-git-repo-check", "--json", "-m", "qwen3"]
        # The summary Codex carries into its next context holds <summary>: only its instruction asks for one.
        replica.backend.config.summary_markers = ("CONTEXT CHECKPOINT COMPACTION",)
        # Each new context restarts the script's rounds: the budget ends the run.
        steer(replica, {"exec_command": {"cmd": NUMBERS}}, 1000)
        replica.backend.config.tool_budget = 44
        run_cli(network, [*codex, "Print the numbers with the shell, again and again."], env=env, cwd=project)
        # An explicit server-side compaction: a provider named `azure` compacts with a compaction_trigger item, here
        # asked for after this turn; the proxy serves it with the model and the next request echoes its item.
        replica.backend.config.summary_markers = (
            "CONTEXT CHECKPOINT COMPACTION",
            "Your context is about to be compacted",
        )
        replica.backend.tool_turns, replica.backend.config.tool_budget = 0, 2
        remote = ["-c", 'model_providers.local.name="azure"', "-c", "model_post_turn_compact_threshold_percent=1"]
        run_cli(network, [*codex, *remote, "resume", "--last", "Print them twice more."], env=env, cwd=project)
        replica.backend.tool_turns, replica.backend.config.tool_budget = 0, 1
        run_cli(network, [*codex, "-c", 'model_providers.local.name="azure"', "resume", "--last", "Once more."],
                env=env, cwd=project)  # fmt: skip
        spawn = {"message": "Run the marker command with the shell and report what it printed.", "$once": True}
        wait = {"$agent_ids": "targets", "timeout_ms": 60000, "$once": True}
        steer(replica, {"multi_agent_v1__spawn_agent": spawn, "multi_agent_v1__wait_agent": wait,
                        "exec_command": {"cmd": NUMBERS}}, 1000)  # fmt: skip
        replica.backend.tool_turns, replica.backend.config.tool_budget = 0, 3  # spawn, the child's call, wait
        run_cli(network, [*codex, "resume", "--last", "Delegate the marker check to a sub-agent."], env=env,
                cwd=project)  # fmt: skip
        refused = re.findall(r"<< ([45]\d\d\b.*)", proxy.output())
        assert not refused, (refused, proxy.output()[-6000:])
        # `codex exec` may end while its sub-agent's last request is still being answered (about every other run
        # here): the proxy logs the hang-up, closes the upstream request and records nothing of it.
        hung_up = len(re.findall(r"<< client disconnected", proxy.output(), re.IGNORECASE))

    assert_token_exact(record_dir, replica, hung_up)
    turns, _ = assert_linked_episode(record_dir, "cx-long", "Codex")
    calls = [t.call for t in turns]
    assert calls.count("compaction") >= 2 and "subagent" in calls, calls
    summaries = [t for t in turns if t.follows is not None and t.follows.how == "summary"]
    served = [t for t in turns if t.call_reason == "a compaction this proxy served (compaction_trigger)"]
    items = [t for t in turns if t.follows is not None and t.follows.how == "compaction_item"]
    assert len(served) >= 1 and len(items) >= 1
    assert {t.follows.turn_id for t in items} <= {t.turn_id for t in served}
    # Every compaction continued from its summary: the local ones by the summary's text, the served by their item.
    assert len(summaries) + len(items) == calls.count("compaction")
    assert tool_round_trips(turns) >= 40
    spawned = [t.follows.tool_call_id for t in turns if t.call == "subagent" and t.follows is not None]
    assert len(spawned) == len(set(spawned))  # sub-agents with the same task: each follows its own call
    sub = next(t for t in turns if t.call == "subagent" and t.follows is not None)
    assert sub.appended_messages[-1]["content"] == spawn["message"] or spawn["message"] in str(sub.appended_messages)
    rows = assert_rows_per_segment(record_dir, tmp_path, replica, "cx-long", turns)
    assert {r["call"] for r in rows} == {"main", "compaction", "subagent"}


def in_namespace(network, call):  # noqa: F811
    """`call()` in a thread inside the test's network namespace: the processes it starts (forked from that thread) and
    the sockets it opens to check on them are all there."""
    import threading

    result: dict = {}

    def run() -> None:
        try:
            network.enter_this_thread()
            result["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def test_a_claude_code_episode_through_two_proxies_sharing_redis(network, agent_clis, replica, tmp_path: Path) -> None:  # noqa: F811
    """The real Claude Code through HAProxy over two proxies on one Redis (all inside the namespace), round robin
    without stickiness: an automatic compaction, `/compact` and a sub-agent, each placed as one proxy places them."""
    from tito_addon.replicas.fleet import ProxyFleet, RedisServer

    if isinstance(network, HostLoopback):
        pytest.skip("the fleet runs inside the namespace")
    fresh(replica)
    record_dir = tmp_path / "rec"
    redis = RedisServer(tmp_path / "redis")
    in_namespace(network, redis.start)
    options = {"tito_session_api_key_prefix": KEY_PREFIX, "tito_session_store": redis.url}
    fleet = ProxyFleet(replica.url, 2, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir,
                       workdir=tmp_path / "fleet", options=options)  # fmt: skip
    try:
        in_namespace(network, fleet.start)
        project = tmp_path / "project"
        project.mkdir()
        env = base_env(
            tmp_path / "home", agent_clis, ANTHROPIC_BASE_URL=fleet.url, ANTHROPIC_API_KEY=KEY_PREFIX + "cc-pair",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1",
            DISABLE_AUTOUPDATER="1", CLAUDE_CODE_AUTO_COMPACT_WINDOW="100000",
        )  # fmt: skip
        claude, tail = str(agent_clis / "claude"), ["--output-format", "stream-json", "--verbose"]
        steer(replica, {"Bash": {"command": NUMBERS, "description": "Print numbers"}}, 60)
        run_cli(network, [claude, "-p", "Print the numbers with Bash, again and again.", "--allowedTools", "Bash",
                          "--max-turns", "20", *tail], env=env, cwd=project, ok=(0, 1))  # fmt: skip
        run_cli(network, [claude, "-p", "--continue", "/compact", *tail], env=env, cwd=project)
        steer(replica, {"Agent": SUBAGENT, "Bash": {"command": NUMBERS, "description": "Print numbers"}}, 1)
        run_cli(network, [claude, "-p", "--continue", "Delegate the marker check to a sub-agent.", "--allowedTools",
                          "Bash", "Agent", *tail], env=env, cwd=project)  # fmt: skip
        refused = re.findall(r"<< ([45]\d\d\b.*)", fleet.output())
        assert not refused, (refused, fleet.output()[-6000:])
    finally:
        in_namespace(network, fleet.stop)
        in_namespace(network, redis.stop)
    assert_token_exact(record_dir, replica)
    turns, _ = assert_linked_episode(record_dir, "cc-pair", "Claude Code")
    calls = [t.call for t in turns]
    assert calls.count("compaction") >= 2 and calls.count("subagent") >= 1, calls
    assert len([t for t in turns if t.follows is not None and t.follows.how == "summary"]) >= 2
    parts = sorted(p.name for p in record_dir.glob("cc-pair*.jsonl"))
    assert len(parts) == 2, parts  # both proxies served turns of the episode


# Gemini CLI refuses command substitution (`$(…)`): the namespace through a pipe. ~14k characters (and Qwen3 tokens)
# a result, so a resumed history of four of them passes the compression threshold below.
GEMINI_NUMBERS = "seq 100000 102000; readlink /proc/self/ns/net | xargs echo tito-ok"
GEMINI_SMALL = "readlink /proc/self/ns/net | xargs echo tito-ok"
# Gemini CLI compresses before a request once the last prompt's token count reaches compressionThreshold times its
# window, 1048576 for a model it does not know (`qwen3`): 0.012 is ~12.6k tokens. A resumed session counts its
# history by characters (/4, each function response twice): the large results pass it. The rebuilt context, counted
# by the replica's usage (the ~10.6k-token system instruction and tools, small results), stays under it: one
# compression, not one before every request (it would compress the snapshot alone again and again).
GEMINI_SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "model": {"compressionThreshold": 0.012},
}
SNAPSHOT = "Then, generate the updated <state_snapshot>."
CHECK = "Critically evaluate the <state_snapshot> you just generated."


def last_user_text(turn) -> str:
    return next(text_of(m.get("content")) for m in reversed(turn.appended_messages) if m["role"] == "user")


def test_a_gemini_cli_episode_is_one_linked_episode(network, agent_clis, replica, tmp_path: Path) -> None:  # noqa: F811
    """Gemini CLI's own chat compression, automatic, twice: four rounds of large shell output, then the session resumed
    past its compression threshold: a <state_snapshot> request and its check, each a new root under the compression
    system instruction, placed `compaction`, then the context rebuilt from the checked snapshot, which follows the
    check turn and continues `main` (small rounds, then a resumed run with larger output); resumed once more, the
    same again, its compaction requests following the first snapshot they hold. The episode is named by the API key."""
    record_dir, project = tmp_path / "rec", tmp_path / "project"
    with episode_proxy(network, replica, tmp_path) as proxy:
        home = tmp_path / "home"
        (home / ".gemini").mkdir(parents=True)
        (home / ".gemini" / "settings.json").write_text(json.dumps(GEMINI_SETTINGS))
        env = base_env(home, agent_clis, GOOGLE_GEMINI_BASE_URL=proxy.url, GEMINI_API_KEY=KEY_PREFIX + "gm-long",
                       GEMINI_SANDBOX="false", GEMINI_CLI_TRUST_WORKSPACE="true")  # fmt: skip
        gemini = [str(agent_clis / "gemini"), "-m", "qwen3", "--approval-mode", "yolo", "--output-format",
                  "stream-json"]  # fmt: skip
        resume = ["--resume", "latest"]
        # Both of its compression requests hold <state_snapshot> in their last user message: answered as summaries.
        replica.backend.config.summary_markers = ("<state_snapshot>",)
        steer(replica, {"run_shell_command": {"command": GEMINI_NUMBERS}}, 3)
        runs = [run_cli(network, [*gemini, "-p", "Print the numbers with the shell."], env=env, cwd=project)]
        steer(replica, {"run_shell_command": {"command": GEMINI_SMALL}}, 3)
        runs.append(run_cli(network, [*gemini, "-p", "Check the folder again.", *resume], env=env, cwd=project))
        # One round whose two results (the replica's parallel turn) pass the threshold again once resumed.
        steer(replica, {"run_shell_command": {"command": GEMINI_NUMBERS.replace("102000", "104000")}}, 1)
        runs.append(run_cli(network, [*gemini, "-p", "Print more numbers.", *resume], env=env, cwd=project))
        # Another snapshot: the second compaction's requests hold only the first's, so each link is unambiguous.
        replica.backend.config.summary_text = "The shell printed the numbers, then the marker of the namespace."
        steer(replica, {"run_shell_command": {"command": GEMINI_SMALL}}, 1)
        runs.append(run_cli(network, [*gemini, "-p", "Check it once more.", *resume], env=env, cwd=project))
        refused = re.findall(r"<< ([45]\d\d\b.*)", proxy.output())
        assert not refused, (refused, proxy.output()[-6000:])

    sessions = set()
    # 3, 3, 1 and 1 rounds; every third turn of the replica's is a parallel pair.
    for run, calls in zip(runs, (4, 4, 2, 1), strict=True):
        events = run.events()
        sessions |= {event["session_id"] for event in events if event["type"] == "init"}
        assert events[-1]["type"] == "result" and events[-1]["status"] == "success", str(run)
        assert events[-1]["stats"]["tool_calls"] == calls, events[-1]
        outputs = [event for event in events if event["type"] == "tool_result"]
        assert all(o["status"] == "success" and f"tito-ok {network.inode}" in o["output"] for o in outputs), outputs
    assert len(sessions) == 1
    turns = assert_token_exact(record_dir, replica)
    turns, _ = assert_linked_episode(record_dir, "gm-long", "Gemini CLI", root_compactions=True)
    assert len(turns) == 16 == len(replica.received())
    roots = [t for t in turns if t.parent_turn_id is None]
    calls = ["main", "compaction", "compaction"] * 2 + ["main"]
    assert [t.call for t in roots] == calls, [(t.turn_id, t.parent_turn_id, t.call) for t in turns]
    first, snapshot, check, rebuilt, snapshot2, check2, rebuilt2 = roots
    for snap, checked in ((snapshot, check), (snapshot2, check2)):
        # The snapshot request, then its check with the snapshot echoed as the model's; neither extends a stored turn.
        assert SNAPSHOT in last_user_text(snap) and CHECK in last_user_text(checked)
        assert checked.appended_messages[-2] == {"role": "assistant", "content": snap.assistant_message["content"]}
        assert snap.model == checked.model == COMPRESSION_MODEL
    assert snapshot.follows is None and check.follows is None
    # The second compaction compresses a history that starts from the first snapshot: both its requests follow it.
    assert snapshot2.follows == check2.follows == rebuilt.follows
    for after, checked in ((rebuilt, check), (rebuilt2, check2)):
        # The rebuilt context: the checked snapshot alone in a part after the environment, and it follows that turn.
        follows = after.follows.model_dump(exclude_none=True)
        assert follows == {"session": "gm-long", "turn_id": checked.turn_id, "how": "summary"}, follows
        parts = [part["text"] for part in after.appended_messages[1]["content"]]
        assert parts[0].startswith("<session_context>") and parts[1:] == [checked.assistant_message["content"]]
    assert summary_text(check) != summary_text(check2)
    # The main segments: a line of turns each (T a tool-call turn, S an answer); a run resumed after a compression
    # extends the rebuilt context's line.
    for root, finishes in ((first, "TTTS"), (rebuilt, "TTTSTS"), (rebuilt2, "TS")):
        chain = [root]
        while len(chain) < len(finishes):
            chain.append(next(t for t in turns if t.parent_turn_id == chain[-1].turn_id))
        assert "".join(t.finish_reason[0].upper() for t in chain) == finishes, chain
        assert {t.call for t in chain} == {"main"} and {t.model for t in chain} == {"qwen3"}
    assert tool_round_trips(turns) == 11
    rows = assert_rows_per_segment(record_dir, tmp_path, replica, "gm-long", turns)
    assert [r["call"] for r in rows] == calls


def summary_text(turn) -> str:
    return re.search(r"<summary>\n(.*)\n</summary>", turn.assistant_message["content"]).group(1)
