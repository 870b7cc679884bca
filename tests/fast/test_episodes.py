"""Whole episodes through a real mitmdump, with the real anthropic and openai SDKs as the agents: a compaction, the
context rebuilt from its summary, a sub-agent and a side call, sent as Claude Code and Codex send them (the texts
measured from the pinned CLIs; README, "Episodes"), each turn placed in its episode (`episode`, `call`, `follows`),
token exact, and exported one row per segment with the episode's reward on every row.

The real CLIs' long episodes are in tests/full/test_agent_episodes.py (the full tier).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anthropic
import openai
import pytest
from support.anthropic_agent import echo
from support.basics import tokenizer_path
from support.episode_scripts import (
    BASH,
    CODEX_COMPACT,
    CODEX_WRAPPER,
    SUBAGENT_PROMPT,
    claude_code_episode,
    results,
)
from support.proxy_harness import REPO
from support.token_exact import assert_token_exact

from tito_addon.records.record_models import AnnotationRecord
from tito_addon.records.record_reader import iter_session_files
from tito_addon.records.trajectory_recorder import TrajectoryRecorder
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def replica():
    config = ReplicaConfig(
        tokenizer=tokenizer_path("qwen3"),
        preferred_tools={"Agent": {"description": "List files", "prompt": SUBAGENT_PROMPT}},
    )
    with ReplicaThread(config) as running:
        yield running


def places(record_dir: Path) -> dict[tuple[str, int], dict]:
    """(session, turn) -> what `show --json` says of the turn's place (and its parent)."""
    shown = subprocess.run(
        [sys.executable, "-m", "tito_addon", "show", str(record_dir), "--json"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    rows = [json.loads(line) for line in shown.stdout.splitlines()]
    keys = ("episode", "call", "follows", "parent_turn_id")
    return {(row["session_id"], row["turn_id"]): {k: row[k] for k in keys} for row in rows}


def named_places(session: str, spawn_call: str) -> dict[tuple[str, int], dict]:
    """What `claude_code_episode` in a named session places where (see `places`)."""
    summary_link = {"session": session, "turn_id": 4, "how": "summary"}
    spawn_link = {"session": session, "turn_id": 5, "tool_call_id": spawn_call, "how": "tool_argument"}
    shape = [("main", None, None), ("main", None, 0), ("main", None, 1), ("main", None, 2), ("compaction", None, 2),
             ("main", summary_link, None), ("subagent", spawn_link, None), ("subagent", None, 6), ("main", None, 5),
             ("side", None, None)]  # fmt: skip
    return {
        (session, turn): {"episode": session, "call": call, "follows": follows, "parent_turn_id": parent}
        for turn, (call, follows, parent) in enumerate(shape)
    }


def export_rows(record_dir: Path, tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / f"rows{len(args)}.jsonl"
    subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), "--to", "jsonl", *args],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_named_claude_code_episode_is_one_episode_of_linked_segments(proxy, replica, tmp_path: Path) -> None:
    api = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", default_headers={"x-session-id": "ep-cc"},
                              max_retries=0)  # fmt: skip
    seen = claude_code_episode(api)
    turns = assert_token_exact(proxy.record_dir, replica)
    assert len(turns) == 10 and {t.session_id for t in turns} == {"ep-cc"}
    assert places(proxy.record_dir) == named_places("ep-cc", seen["spawn_call"])
    by_id = {t.turn_id: t for t in turns}
    assert by_id[4].call_reason == "Claude Code's compaction instruction"
    assert "no recorded summary" in by_id[9].call_reason
    # The episode's reward, given on one turn, reaches every segment; one scoped to a segment stays there.
    recorder = TrajectoryRecorder(proxy.record_dir)
    recorder.write_annotation(AnnotationRecord(session_id="ep-cc", turn_id=8, reward=1.0, labels=["done"], ts=1e10))
    recorder.write_annotation(AnnotationRecord(session_id="ep-cc", turn_id=9, reward=0.0, scope="segment", ts=2e10))
    rows = export_rows(proxy.record_dir, tmp_path)
    shape = [(r["segment"], r["call"], r["turn_ids"], r["reward"]) for r in rows]
    assert shape == [
        (0, "main", [0, 1, 2, 3], 1.0),
        (1, "compaction", [4], 1.0),
        (2, "main", [5, 8], 1.0),
        (3, "subagent", [6, 7], 1.0),
        (4, "side", [9], 0.0),
    ]
    assert {r["episode"] for r in rows} == {"ep-cc"} and all(r["labels"] == ["done"] for r in rows)
    # Each row's ids are the leaf's exact prompt + completion; it trains on its own segment's completions only.
    (session_file,) = iter_session_files(proxy.record_dir)
    full = session_file.full_ids()
    for row in rows:
        prompt, completion = full[row["leaf_turn_id"]]
        assert row["input_ids"] == prompt + completion
        sampled = [i for i, bit in enumerate(row["loss_mask"]) if bit]
        expected = [by_id[t].prompt_len + k for t in row["turn_ids"] for k in range(len(by_id[t].completion_ids))]
        assert sampled == expected
    # Side calls left out; the others keep their numbers in the episode.
    kept = export_rows(proxy.record_dir, tmp_path, "--calls", "main,compaction,subagent")
    assert [(r["segment"], r["call"]) for r in kept] == [(0, "main"), (1, "compaction"), (2, "main"), (3, "subagent")]
    bad = subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(proxy.record_dir), str(tmp_path / "x"), "--calls", "mian"],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown call(s) mian" in bad.stderr and not (tmp_path / "x").exists()


def test_an_automatic_claude_code_episode_links_its_sessions_by_content(proxy, replica, tmp_path: Path) -> None:
    """Without a name each new root is an automatic session of its own: the context rebuilt from a summary and the
    sub-agent join the episode of the turns they follow (across sessions); the unlinked side call starts its own."""
    api = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", max_retries=0)
    seen = claude_code_episode(api)
    turns = assert_token_exact(proxy.record_dir, replica)
    assert len(turns) == 10
    by_order = sorted(turns, key=lambda t: t.ts)
    first, rebuilt, sub, side = by_order[0], by_order[5], by_order[6], by_order[9]
    episode = f"{first.session_id}/0"
    sessions = {t.session_id for t in turns}
    assert len(sessions) == 4 and len({first.session_id, rebuilt.session_id, sub.session_id, side.session_id}) == 4
    assert [t.episode for t in by_order[:9]] == [episode] * 9 and side.episode == f"{side.session_id}/0"
    assert [t.call for t in by_order] == ["main"] * 4 + ["compaction", "main", "subagent", "subagent", "main", "main"]
    assert rebuilt.follows.model_dump(exclude_none=True) == {
        "session": first.session_id,
        "turn_id": 4,
        "how": "summary",
    }
    spawned = {"session": rebuilt.session_id, "turn_id": rebuilt.turn_id, "tool_call_id": seen["spawn_call"]}
    assert sub.follows.model_dump(exclude_none=True) == {**spawned, "how": "tool_argument"}
    rows = export_rows(proxy.record_dir, tmp_path)
    ours = [r for r in rows if r["episode"] == episode]
    assert [(r["segment"], r["call"], r["session_id"]) for r in ours] == [
        (0, "main", first.session_id),
        (1, "compaction", first.session_id),
        (2, "main", rebuilt.session_id),
        (3, "subagent", sub.session_id),
    ]


def test_a_codex_compaction_continues_in_the_context_rebuilt_from_its_summary(proxy, replica) -> None:
    """Codex's local compaction through the openai SDK's Responses API: the summary request extends the history
    with its instruction; the next context holds the summary verbatim."""
    api = openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0)
    schema = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
    tools = [{"type": "function", "name": "exec_command", "description": "Run a command.", "parameters": schema}]
    items: list = [{"role": "user", "content": "Check this folder."}]
    call = api.responses.create(model="qwen3", input=items, tools=tools, instructions="You are Codex.")
    calls = [item for item in call.output if item.type == "function_call"]
    items += [item.model_dump(exclude_none=True) for item in call.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "a.txt"} for c in calls]
    answer = api.responses.create(model="qwen3", input=items, tools=tools, instructions="You are Codex.")
    items += [item.model_dump(exclude_none=True) for item in answer.output]
    compact = [*items, {"role": "user", "content": CODEX_COMPACT}]
    summary = api.responses.create(model="qwen3", input=compact, tools=tools, instructions="You are Codex.")
    text = summary.output_text
    rebuilt = [{"role": "user", "content": "Check this folder."},
               {"role": "user", "content": CODEX_WRAPPER.format(summary=text)}]  # fmt: skip
    api.responses.create(model="qwen3", input=rebuilt, tools=tools, instructions="You are Codex.")
    turns = sorted(assert_token_exact(proxy.record_dir, replica), key=lambda t: t.ts)
    assert [t.call for t in turns] == ["main", "main", "compaction", "main"]
    assert turns[2].parent_turn_id == turns[1].turn_id and turns[2].call_reason == "Codex's compaction instruction"
    assert turns[3].parent_turn_id is None and turns[3].session_id != turns[0].session_id
    assert turns[3].episode == turns[0].episode == f"{turns[0].session_id}/0"
    assert turns[3].follows.model_dump(exclude_none=True) == {
        "session": turns[0].session_id, "turn_id": turns[2].turn_id, "how": "summary"
    }  # fmt: skip


def responses_api(proxy, session: str | None = None) -> openai.OpenAI:
    headers = {"x-session-id": session} if session else None
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-x", max_retries=0, default_headers=headers)


EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}


def worked(api: openai.OpenAI) -> list:
    """A tool round trip and its answer: a conversation worth compacting."""
    items: list = [{"role": "user", "content": "Check this folder."}]
    call = api.responses.create(model="qwen3", input=items, tools=[EXEC], instructions="You are Codex.")
    items += [item.model_dump(exclude_none=True) for item in call.output]
    calls = [item for item in call.output if item.type == "function_call"]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "a.txt"} for c in calls]
    answer = api.responses.create(model="qwen3", input=items, tools=[EXEC], instructions="You are Codex.")
    return items + [item.model_dump(exclude_none=True) for item in answer.output]


@pytest.mark.parametrize("stream", [False, True])
def test_a_compaction_trigger_is_served_by_the_model_and_continued_from_its_item(proxy, replica, stream) -> None:
    """Codex's server-side compaction (a provider named `azure`): the trigger's turn is the model's own summary,
    recorded token exact as a compaction; its sealed item starts the next context, which follows it."""
    api = responses_api(proxy, "cx-remote")
    items = worked(api)
    trigger = [*items, {"type": "compaction_trigger"}]
    if stream:
        with api.responses.stream(model="qwen3", input=trigger, tools=[EXEC], instructions="You are Codex.") as events:
            kinds = [event.type for event in events]
            compacted = events.get_final_response()
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.output_text.delta" not in kinds and "response.reasoning_text.delta" not in kinds
    else:
        compacted = api.responses.create(model="qwen3", input=trigger, tools=[EXEC], instructions="You are Codex.")
    (item,) = compacted.output
    assert item.type == "compaction" and item.id.startswith("cmp_") and item.encrypted_content
    # Codex's next context: its instructions and user messages, then the compaction item as it came.
    rebuilt = [items[0], item.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    nxt = api.responses.create(model="qwen3", input=rebuilt, tools=[EXEC], instructions="You are Codex.")
    rebuilt += [i.model_dump(exclude_none=True) for i in nxt.output]
    calls = [i for i in nxt.output if i.type == "function_call"]
    rebuilt += [{"type": "function_call_output", "call_id": c.call_id, "output": "b.txt"} for c in calls]
    api.responses.create(model="qwen3", input=rebuilt, tools=[EXEC], instructions="You are Codex.")
    turns = sorted(assert_token_exact(proxy.record_dir, replica), key=lambda t: t.ts)
    assert [t.call for t in turns] == ["main", "main", "compaction", "main", "main"]
    summary, root, after = turns[2], turns[3], turns[4]
    assert summary.parent_turn_id == turns[1].turn_id
    assert summary.call_reason == "a compaction this proxy served (compaction_trigger)"
    assert summary.appended_messages[-1]["content"].startswith("Your context is about to be compacted.")
    assert root.parent_turn_id is None and after.parent_turn_id == root.turn_id
    assert root.follows.model_dump(exclude_none=True) == {
        "session": "cx-remote",
        "turn_id": 2,
        "how": "compaction_item",
    }
    # The item reads as the summary the model wrote (the inside of its <summary> block).
    text = summary.assistant_message["content"]
    inside = text.split("<summary>")[1].split("</summary>")[0].strip()
    assert root.appended_messages[2] == {"role": "user", "content": inside}  # after the instructions and the task


def test_the_compact_endpoint_answers_the_user_messages_and_a_sealed_item(proxy, replica) -> None:
    api = responses_api(proxy)
    items = worked(api)
    raw = api.responses.with_raw_response.compact(model="qwen3", input=items, instructions="You are Codex.")
    compacted = json.loads(raw.text)  # as it came: what Codex echoes
    assert compacted["object"] == "response.compaction"
    assert [o["type"] for o in compacted["output"]] == ["message", "compaction"]
    assert compacted["output"][0]["content"] == [{"type": "input_text", "text": "Check this folder."}]
    assert compacted["usage"]["input_tokens"] > 0 and compacted["usage"]["output_tokens"] > 0
    rebuilt = [*compacted["output"], {"role": "user", "content": "Go on."}]
    api.responses.create(model="qwen3", input=rebuilt, tools=[EXEC], instructions="You are Codex.")
    turns = sorted(assert_token_exact(proxy.record_dir, replica), key=lambda t: t.ts)
    assert [t.call for t in turns] == ["main", "main", "compaction", "main"]
    assert turns[2].call_reason == "a compaction this proxy served (the compact endpoint)"
    assert turns[3].follows.how == "compaction_item" and turns[3].follows.turn_id == turns[2].turn_id
    assert turns[3].episode == turns[0].episode


def test_bad_compactions_are_refused_in_the_responses_shape_and_record_nothing(proxy, replica) -> None:
    api = responses_api(proxy, "cx-a")
    items = worked(api)
    compacted = api.responses.create(model="qwen3", input=[*items, {"type": "compaction_trigger"}], tools=[EXEC])
    item = compacted.output[0].model_dump(exclude_none=True)
    before = len(replica.generated())
    forged = {**item, "encrypted_content": item["encrypted_content"][:-4] + "AAAA"}
    cases = {
        "forged": (responses_api(proxy, "cx-a"), [items[0], forged], "did not mint"),
        "another session's": (responses_api(proxy, "cx-b"), [items[0], item], "belongs to another session"),
        "nothing to compact": (responses_api(proxy, "cx-c"), [{"type": "compaction_trigger"}], "nothing to compact"),
        "trigger not last": (api, [*items, {"type": "compaction_trigger"}, items[0]], "must be the last item"),
    }
    for name, (client, given, words) in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="qwen3", input=given, tools=[EXEC], instructions="You are Codex.")
        assert words in refused.value.message and refused.value.body["type"] == "invalid_request_error", name
    with pytest.raises(openai.BadRequestError):
        responses_api(proxy, "cx-c").responses.compact(model="qwen3", input=[], instructions="You are Codex.")
    assert len(replica.generated()) == before  # nothing forwarded
    recorded = {t.session_id for t in assert_token_exact(proxy.record_dir, replica)}
    assert recorded == {"cx-a"}


def test_the_control_api_serves_an_episodes_segments_and_scopes_its_notes(replica, tmp_path: Path) -> None:
    """The control API's rows take `calls` as export does (the same bytes), and a note scoped to a segment stays
    there while the episode's reward reaches every row."""
    from tito_addon.client import TitoClient, TitoControlError
    from tito_addon.replicas.proxy_process import Mitmdump

    replica.backend.reset()
    token, record_dir = "episode-control-token-0123", tmp_path / "rec"
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  options={"tito_control_token": token}) as proxy:  # fmt: skip
        api = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", default_headers={"x-session-id": "ep-ctl"},
                                  max_retries=0)  # fmt: skip
        claude_code_episode(api)
        with TitoClient(proxy.url, token) as tito:
            tito.annotate("ep-ctl", reward=0.5)
            tito.annotate("ep-ctl", turn_id=4, reward=0.25, scope="segment", labels=["summary"])
            rows = tito.rows("ep-ctl")
            assert [(r["segment"], r["call"], r["reward"]) for r in rows] == [
                (0, "main", 0.5), (1, "compaction", 0.25), (2, "main", 0.5), (3, "subagent", 0.5), (4, "side", 0.5)
            ]  # fmt: skip
            assert [r["labels"] for r in rows] == [[], ["summary"], [], [], []]
            kept = tito.rows("ep-ctl", calls="main,subagent")
            assert [(r["segment"], r["call"]) for r in kept] == [(0, "main"), (2, "main"), (3, "subagent")]
            fetched = tito.rows_parquet("ep-ctl", format="verl", calls="main,subagent")
            with pytest.raises(TitoControlError) as refused:
                tito.rows("ep-ctl", calls="main,bogus")
            assert refused.value.status == 400
            with pytest.raises(TitoControlError) as bad_scope:
                tito.annotate("ep-ctl", turn_id=1, reward=1.0, scope="branch")
            assert bad_scope.value.status == 400
    out = tmp_path / "kept.parquet"
    argv = ["export", str(record_dir), str(out), "--session", "ep-ctl", "--format", "verl", "--calls", "main,subagent"]
    subprocess.run([sys.executable, "-m", "tito_addon", *argv], cwd=REPO, check=True, capture_output=True)
    assert out.read_bytes() == fetched


def test_two_proxies_sharing_redis_place_every_turn_the_same(replica, redis_server, tmp_path: Path) -> None:
    """The same episodes through two proxies on one Redis (`tito_session_store`), request by request on alternate
    proxies: the summary a proxy recorded links the context the other one serves, and so do sub-agents; named and
    automatic, the structure is what one proxy gives."""
    from tito_addon.replicas.proxy_process import Mitmdump

    replica.backend.reset()
    record_dir = tmp_path / "rec"
    options = {"tito_session_store": redis_server.url}
    proxies = []
    try:
        for index in range(2):
            (tmp_path / f"p{index}").mkdir()
            proxies.append(Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir,
                                    cwd=tmp_path / f"p{index}", options=options).start())  # fmt: skip

        def clients(**headers: str) -> list[anthropic.Anthropic]:
            return [anthropic.Anthropic(base_url=p.url, api_key="sk-ant-x", default_headers=headers or None,
                                        max_retries=0) for p in proxies]  # fmt: skip

        named = claude_code_episode(*clients(**{"x-session-id": "ep-pair"}))
        automatic = claude_code_episode(*clients())
        # A compaction one proxy serves, continued on the other from its item (the signing key is the record dir's).
        first, second = (responses_api(p, "cx-pair") for p in proxies)
        items = worked(first)
        trigger = [*items, {"type": "compaction_trigger"}]
        compacted = second.responses.create(model="qwen3", input=trigger, tools=[EXEC])
        rebuilt = [items[0], compacted.output[0].model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        first.responses.create(model="qwen3", input=rebuilt, tools=[EXEC])
    finally:
        for proxy in proxies:
            proxy.stop()
    turns = assert_token_exact(record_dir, replica)
    assert len(turns) == 24
    served = sorted((t for t in turns if t.session_id == "cx-pair"), key=lambda t: t.ts)
    assert [t.call for t in served] == ["main", "main", "compaction", "main"]
    assert served[3].follows.model_dump(exclude_none=True) == {"session": "cx-pair", "turn_id": served[2].turn_id,
                                                               "how": "compaction_item"}  # fmt: skip
    turns = [t for t in turns if t.session_id != "cx-pair"]
    got = places(record_dir)
    assert {k: v for k, v in got.items() if k[0] == "ep-pair"} == named_places("ep-pair", named["spawn_call"])
    auto = sorted((t for t in turns if t.session_id != "ep-pair"), key=lambda t: t.ts)
    episode = f"{auto[0].session_id}/0"
    assert [t.call for t in auto] == ["main"] * 4 + ["compaction", "main", "subagent", "subagent", "main", "main"]
    assert [t.episode for t in auto[:9]] == [episode] * 9
    assert auto[5].follows.model_dump(exclude_none=True) == {"session": auto[0].session_id, "turn_id": 4,
                                                             "how": "summary"}  # fmt: skip
    assert auto[6].follows.tool_call_id == automatic["spawn_call"] and auto[6].follows.session == auto[5].session_id


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


def test_an_episode_replays_with_its_compactions_and_sub_agents(proxy, replica, tmp_path: Path) -> None:
    """Offline replay serves a recorded episode to the same agent again: the compaction, the context rebuilt from
    its summary (a served compaction's item included), the sub-agent and the side call, with no backend."""
    from support.tito_commands import replay_proxy

    named = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", default_headers={"x-session-id": "ep-re"},
                                max_retries=0)  # fmt: skip
    seen = claude_code_episode(named)
    api = responses_api(proxy, "cx-re")
    items = worked(api)
    compacted = api.responses.create(model="qwen3", input=[*items, {"type": "compaction_trigger"}], tools=[EXEC])
    rebuilt = [items[0], compacted.output[0].model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
    after = api.responses.create(model="qwen3", input=rebuilt, tools=[EXEC])
    served = len(replica.generated())
    with replay_proxy(proxy.record_dir, tmp_path) as again:
        named = anthropic.Anthropic(base_url=again.url, api_key="sk-ant-x",
                                    default_headers={"x-session-id": "ep-re"}, max_retries=0)  # fmt: skip
        assert claude_code_episode(named) == seen
        api = responses_api(again, "cx-re")
        assert without_ids(worked(api)) == without_ids(items)  # the same items; the ids minted again
        replayed = api.responses.create(model="qwen3", input=[*items, {"type": "compaction_trigger"}], tools=[EXEC])
        assert [o.type for o in replayed.output] == ["compaction"]
        rebuilt = [items[0], replayed.output[0].model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        answer = api.responses.create(model="qwen3", input=rebuilt, tools=[EXEC])
        assert [o.model_dump(exclude={"id"}) for o in answer.output] == [
            o.model_dump(exclude={"id"}) for o in after.output
        ]
    assert len(replica.generated()) == served  # the replay asked no backend


def test_redrive_keeps_each_turns_place_in_its_episode(proxy, replica, tmp_path: Path) -> None:
    from support.tito_commands import redrive

    api = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", default_headers={"x-session-id": "ep-rd"},
                              max_retries=0)  # fmt: skip
    claude_code_episode(api)
    turns = {t.turn_id: t for t in assert_token_exact(proxy.record_dir, replica)}
    report = redrive(proxy.record_dir, replica.url, tmp_path / "gap.json")
    assert [(g["turn_id"], g["episode"], g["call"]) for g in report["turns"]] == [
        (t.turn_id, "ep-rd", t.call) for t in turns.values()
    ]
    assert {call: totals["turns"] for call, totals in report["by_call"].items()} == {
        "main": 6, "compaction": 1, "subagent": 2, "side": 1
    }  # fmt: skip
    assert report["by_call"]["compaction"]["tokens"] == len(turns[4].completion_ids)


def test_anthropic_server_side_compaction_is_served_by_the_model_and_continued(proxy, replica) -> None:
    """`context_management` with `compact_20260112` through the anthropic SDK: below the trigger a turn is a turn;
    past it the model writes the summary (a token-exact compaction turn) and the answer is one compaction block
    (`stop_reason: "compaction"`). The agent sends it back, and everything before it is dropped: the next context is
    the summary, which follows the summary turn; a forged block is a 400."""
    api = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", default_headers={"x-session-id": "ep-srv"},
                              max_retries=0)  # fmt: skip
    edits = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 300},
                        "pause_after_compaction": True}]}  # fmt: skip
    beta = ["compact-2026-01-12"]

    def create(messages, stream=False):
        kw = {"model": "qwen3", "max_tokens": 400, "tools": [BASH], "messages": messages, "betas": beta,
              "context_management": edits, "system": "You are an agent."}  # fmt: skip
        if stream:
            with api.beta.messages.stream(**kw) as events:
                kinds = [event.type for event in events]
                return events.get_final_message(), kinds
        return api.beta.messages.create(**kw), None

    messages: list[dict] = [{"role": "user", "content": "Check this folder."}]
    first, _ = create(messages)  # a short prompt: an ordinary turn
    assert first.stop_reason == "tool_use"
    messages += [echo(first), results(first, "a.txt\\n" * 120)]  # the tool output passes the trigger
    compacted, kinds = create(messages, stream=True)
    assert compacted.stop_reason == "compaction" and [b.type for b in compacted.content] == ["compaction"]
    assert "content_block_start" in kinds and "message_stop" in kinds
    block = compacted.content[0]
    assert block.content and block.encrypted_content
    messages += [{"role": "assistant", "content": [block.model_dump(exclude_none=True)]}]
    going_on, _ = create(messages)  # the summary is the whole context now
    assert going_on.stop_reason in ("end_turn", "tool_use")
    messages += [echo(going_on), {"role": "user", "content": "Thanks."}]
    create(messages)
    turns = sorted(assert_token_exact(proxy.record_dir, replica), key=lambda t: t.ts)
    assert [t.call for t in turns] == ["main", "compaction", "main", "main"]
    assert turns[1].parent_turn_id == 0 and turns[1].call_reason == "a compaction this proxy served (compact_20260112)"
    assert turns[1].prompt_len >= 300 > turns[0].prompt_len
    assert turns[2].parent_turn_id is None and turns[3].parent_turn_id == turns[2].turn_id
    assert turns[2].follows.model_dump(exclude_none=True) == {
        "session": "ep-srv",
        "turn_id": 1,
        "how": "compaction_item",
    }
    assert turns[2].appended_messages[1] == {"role": "user", "content": block.content}  # after the system prompt
    assert turns[2].prompt_len < turns[1].prompt_len  # the context was compacted
    forged = {**block.model_dump(exclude_none=True), "content": "Something else entirely, said to be the summary."}
    before = len(replica.generated())
    with pytest.raises(anthropic.BadRequestError) as refused:
        create([*messages[:3], {"role": "assistant", "content": [forged]}])
    assert "did not mint" in refused.value.message and len(replica.generated()) == before
    with pytest.raises(anthropic.BadRequestError) as unpaused:
        api.beta.messages.create(model="qwen3", max_tokens=10, messages=messages[:1], betas=beta,
                                 context_management={"edits": [{"type": "compact_20260112"}]})  # fmt: skip
    assert "pause_after_compaction: true" in unpaused.value.message
