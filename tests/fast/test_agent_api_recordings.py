"""Sessions recorded through Anthropic Messages and OpenAI Responses work with every offline tool: `show` rebuilds
their exact prompts, `export` gives trainer rows, `audit` and `redrive` read them, and offline replay answers each
in the API the agent asks in (streamed when asked), with no backend."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import openai
import pytest
from support.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from support.anthropic_agent import echo as anthropic_echo
from support.anthropic_agent import tool_results
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump
from support.responses_agent import echo as responses_echo
from support.responses_agent import outputs
from support.tito_commands import replay_proxy, run_cli

from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def anthropic_session(api: anthropic.Anthropic, stream: bool = False) -> list:
    """Two tool round trips and a final answer; the replies as the agent saw them."""
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    replies = []
    for _ in range(3):
        kwargs = {"model": "qwen3", "max_tokens": 512, "tools": ANTHROPIC_TOOLS, "messages": messages}
        if stream:
            with api.messages.stream(**kwargs) as running:
                reply = running.get_final_message()
        else:
            reply = api.messages.create(**kwargs)
        replies.append(reply)
        messages = [*messages, anthropic_echo(reply)]
        if reply.stop_reason != "tool_use":
            break
        messages.append(tool_results(reply))
    return replies


def responses_session(api: openai.OpenAI, stream: bool = False) -> list:
    items: list[dict] = [{"role": "user", "content": "Weather in Rome?"}]
    replies = []
    for _ in range(3):
        kwargs = {"model": "qwen3", "input": items, "tools": RESPONSES_TOOLS}
        if stream:
            with api.responses.stream(**kwargs) as running:
                reply = running.get_final_response()
        else:
            reply = api.responses.create(**kwargs)
        replies.append(reply)
        items = [*items, *responses_echo(reply)]
        if not any(item.type == "function_call" for item in reply.output):
            break
        items += outputs(reply)
    return replies


def anthropic_view(reply) -> list:
    return [
        (b.type, getattr(b, "text", None), getattr(b, "id", None), getattr(b, "input", None)) for b in reply.content
    ]


def responses_view(reply) -> list:
    return [(i.type, getattr(i, "call_id", None), getattr(i, "arguments", None)) for i in reply.output] + [
        reply.output_text
    ]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("rec")
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent
    ) as proxy:  # fmt: skip
        claude = anthropic_session(anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0))
        codex = responses_session(openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0))
        generated = replica.generated()
    assert [r.stop_reason for r in claude] == ["tool_use", "end_turn"]
    assert len(codex) == 2
    return record_dir, claude, codex, generated


def test_each_line_is_exactly_what_its_turn_record_writes(recorded) -> None:
    """The addon builds a line's fields without a TurnRecord (`turns.turn_record`): they must be what validating and
    dumping one gives, field for field, omitted defaults included (items, reply ids, tools, thinking)."""
    record_dir = recorded[0]
    lines = [json.loads(line) for path in record_dir.glob("*.jsonl") for line in path.read_text("utf-8").splitlines()]
    turns = [line for line in lines if line.get("schema") == "tito.turn.v1"]
    assert {line["api"] for line in turns} == {"anthropic_messages", "openai_responses"}
    assert all(line.get("tools") and line.get("appended_items") and line.get("reply_id") for line in turns[:1])
    for line in turns:
        assert TurnRecord.model_validate(line).line_fields() == line


def test_show_rebuilds_the_exact_prompts(recorded, tmp_path: Path) -> None:
    record_dir, _, _, generated = recorded
    shown = [json.loads(line) for line in run_cli("show", str(record_dir), "--json").stdout.splitlines()]
    assert sorted(t["api"] for t in shown) == ["anthropic_messages"] * 2 + ["openai_responses"] * 2
    pairs = {(tuple(t["prompt_ids"]), tuple(t["completion_ids"])) for t in shown}
    assert pairs == {(tuple(g["prompt_ids"]), tuple(g["completion_ids"])) for g in generated}


def test_export_gives_one_row_per_branch(recorded, tmp_path: Path) -> None:
    record_dir, _, _, _ = recorded
    out = tmp_path / "rows.jsonl"
    run_cli("export", str(record_dir), str(out), "--format", "jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    files = {f.turns[0].session_id: f for f in iter_session_files(record_dir)}
    for row in rows:
        session_file = files[row["session_id"]]
        prompt, completion = session_file.full_ids()[row["leaf_turn_id"]]
        assert row["input_ids"] == prompt + completion
        assert sum(row["loss_mask"]) == sum(len(t.completion_ids) for t in session_file.turns)


def test_audit_and_redrive_read_them(recorded, tmp_path: Path) -> None:
    record_dir, _, _, _ = recorded
    out = tmp_path / "audit.json"
    assert "2 branches" in run_cli("audit", str(record_dir), "--json", str(out)).stdout
    assert len(json.loads(out.read_text())) == 2
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as newer:
        report_path = tmp_path / "redrive.json"
        run_cli("redrive", str(record_dir), "--backend", newer.url, "--json", str(report_path))
    report = json.loads(report_path.read_text())
    assert report["totals"]["turns"] == 4


@pytest.mark.parametrize("stream", [False, True])
def test_offline_replay_answers_in_the_api_asked(recorded, tmp_path: Path, stream: bool) -> None:
    record_dir, claude, codex, _ = recorded
    with replay_proxy(record_dir, tmp_path) as proxy:
        again_claude = anthropic_session(
            anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-client", max_retries=0), stream
        )
        again_codex = responses_session(openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", max_retries=0), stream)
        missing = anthropic.Anthropic(base_url=proxy.url, api_key="k", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as raised:
            missing.messages.create(model="qwen3", max_tokens=9, messages=[{"role": "user", "content": "Never asked."}])
    assert [anthropic_view(r) for r in again_claude] == [anthropic_view(r) for r in claude]
    assert [responses_view(r) for r in again_codex] == [responses_view(r) for r in codex]
    assert [r.usage.input_tokens for r in again_claude] == [r.usage.input_tokens for r in claude]
    assert raised.value.body["error"]["type"] == "not_found_error"
    assert raised.value.body["error"]["matched_messages"] == 0
