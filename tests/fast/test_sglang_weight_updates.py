"""Generations that live through weight updates on sglang: the openai SDK -> a real mitmdump -> the sglang replica,
whose engine a "trainer" (the test) pauses, relabels and resumes as ../shared/docs/weight-updates.md §1 describes.

sglang ends a generation cut by `/pause_generation` (abort mode), `/update_weight_version` (it aborts every request by
default) or `/abort_request` with a graceful abort: HTTP 200, `finish_reason: "abort"`, the partial ids and log-probs in
`meta_info`. Its chat endpoint parses each request's output alone, so the proxy resubmits `prompt + partial` under a
fresh rid and has the server's own parsers read the whole completion once: the agent gets the answer an uncut
generation gives, whole or streamed, and the record holds both attempts' ids, log-probs and per-token versions. An
`in_place` pause holds the request instead: nothing is resubmitted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump, post
from support.tito_commands import redrive, replay_proxy
from support.weight_updates import during, turns

from tito_addon.client import TitoClient
from tito_addon.records.record_reader import read_session
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOKEN = "sglang-resume-control-token-0123"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def sglang():
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), token_delay_s=0.01, answer_sentences=2)
    with ReplicaThread(config) as replica:
        yield replica


@pytest.fixture(scope="module")
def proxy(sglang, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("rec")
    options = {"tito_backend_kind": "sglang", "tito_resume_max": "3", "tito_control_token": TOKEN}
    with Mitmdump(
        sglang.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent, options=options
    ) as running:
        running.record_dir = record_dir
        yield running


@pytest.fixture
def engine(sglang):
    sglang.backend.reset()
    sglang.backend.config.weight_version = "default"
    sglang.backend.config.token_delay_s = 0.01  # a test that must cut within a few tokens samples slower
    sglang.backend.pause.stall_at = None
    yield sglang
    sglang.backend.pause.stall_at = None  # (a test that failed before its pause)
    if sglang.backend.pause.paused:
        post(sglang.url + "/continue_generation")


def ask(
    proxy: Mitmdump,
    session: str,
    *,
    stream: bool,
    tools: bool = False,
    messages: list = MESSAGES,
    timeout: float = 60,
    stop: list[str] | None = None,
) -> dict:
    """One turn as the agent sees it: its message (streamed: accumulated from the deltas) and finish reason."""
    client = openai.OpenAI(
        base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0,
        timeout=timeout,
    )  # fmt: skip
    extra: dict = {"tools": TOOLS} if tools else {}
    if stop:
        extra["stop"] = stop
    if not stream:
        reply = client.chat.completions.create(model="qwen3", messages=messages, max_tokens=500, **extra)
        message = reply.choices[0].message.model_dump()
        return {**message, "finish_reason": reply.choices[0].finish_reason}
    with client.chat.completions.stream(model="qwen3", messages=messages, max_tokens=500, **extra) as events:
        content = [event.delta for event in events if event.type == "content.delta"]
        final = events.get_final_completion()
    message = final.choices[0].message.model_dump()
    assert "".join(content) == (message["content"] or "")
    return {**message, "finish_reason": final.choices[0].finish_reason}


def answer_of(message: dict) -> dict:
    """What two answers to one prompt must share: the text, the reasoning, the calls (whose ids are fresh)."""
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    extra = message.get("model_extra") or {}
    reasoning = message.get("reasoning_content") or extra.get("reasoning_content")
    return {"content": message.get("content") or None, "reasoning": reasoning, "calls": calls,
            "finish_reason": message["finish_reason"]}  # fmt: skip


def sampled(engine, tokens: int, rid: str | None = None) -> str:
    """Once a generation (the one named `rid`, else any) has sampled `tokens`: its rid."""
    deadline = time.monotonic() + 20
    while True:
        for generation in list(engine.backend.pause.in_flight.values()):
            if (rid is None or generation.rid == rid) and len(generation.labels) >= tokens:
                return generation.rid
        assert time.monotonic() < deadline, "no generation got that far"
        time.sleep(0.005)


def cut_by(engine, how: str, after_tokens: int) -> None:
    """The trainer's side, once a generation has sampled `after_tokens`: an abort-mode pause, an update to "v2",
    the resume (`pause`), or only the update, which aborts everything in flight by default (`relabel`)."""
    sampled(engine, after_tokens)
    if how == "pause":
        assert post(engine.url + "/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
        assert post(engine.url + "/update_weight_version", json={"new_version": "v2"}).status_code == 200
        time.sleep(0.2)  # the update takes a while; the resubmitted attempt waits in the engine's queue
        assert post(engine.url + "/continue_generation").json()["status"] == "ok"
    else:
        assert post(engine.url + "/update_weight_version", json={"new_version": "v2"}).status_code == 200


@pytest.mark.parametrize(
    ("stream", "tools", "how"),
    [(False, False, "pause"), (True, False, "pause"), (False, True, "relabel"), (True, True, "pause")],
    ids=["whole", "streamed", "whole-tool-call-relabel", "streamed-tool-call"],
)
def test_a_cut_generation_is_resumed_to_the_answer_an_uncut_one_gives(proxy, engine, stream, tools, how) -> None:
    session = f"{how}-{stream}-{tools}"
    uncut_answer = ask(proxy, f"uncut-{session}", stream=stream, tools=tools)
    (uncut,) = turns(proxy.record_dir, f"uncut-{session}")
    engine.backend.reset()
    ids = uncut.completion_ids
    # Mid-reasoning; with tools, inside the call, so that neither attempt alone parses into the answer.
    tool_start = engine.backend.tokenizer.encode("<tool_call>")[0]
    at = ids.index(tool_start) + 4 if tools else 12
    assert at < len(ids) - 12
    engine.backend.config.token_delay_s = 0.03  # the pause must land before the few tokens after `at` are out

    thread, out = during(ask, proxy, session, stream=stream, tools=tools)
    cut_by(engine, how, at)
    thread.join(60)
    assert "error" not in out, out.get("error")
    assert answer_of(out["value"]) == answer_of(uncut_answer)  # no trace of the cut in what the agent reads
    if tools:
        assert out["value"]["tool_calls"] and out["value"]["finish_reason"] == "tool_calls"

    (turn,) = turns(proxy.record_dir, session)
    assert turn.completion_ids == ids and turn.completion_logprobs == uncut.completion_logprobs
    assert turn.finish_reason == uncut.finish_reason
    assert answer_of({**turn.assistant_message, "finish_reason": turn.finish_reason}) == answer_of(
        {**uncut.assistant_message, "finish_reason": uncut.finish_reason}
    )
    first, second = engine.backend.generated_copy()
    cut = len(first["completion_ids"])
    assert at <= cut < len(ids)
    assert second["prompt_ids"] == first["prompt_ids"] + ids[:cut]  # prompt + partial, exactly
    assert first["completion_ids"] + second["completion_ids"] == ids
    # sglang aborts by rid prefix: each attempt runs under a fresh rid that no other starts with.
    assert first["rid"] != second["rid"] and not second["rid"].startswith(first["rid"])
    sent = [body for body in engine.backend.received_copy()]
    assert sent[1]["rid"] == second["rid"] and sent[1]["max_tokens"] == 500 - cut
    assert turn.resumed is not None and turn.resumed.attempts == 2 and turn.resumed.cuts == [cut]
    assert turn.weight_version == "v2"
    if stream:  # sglang's chat stream carries no versions: the first attempt's tokens have none, nothing invented
        expected = [{"version": None, "start": 0, "end": cut}, {"version": "v2", "start": cut, "end": len(ids)}]
    else:
        expected = [{"version": "default", "start": 0, "end": cut}, {"version": "v2", "start": cut, "end": len(ids)}]
    assert turn.weight_version_spans == expected


def test_an_in_place_pause_holds_the_generation_and_nothing_is_resubmitted(proxy, engine) -> None:
    thread, out = during(ask, proxy, "in-place", stream=False)
    sampled(engine, 12)
    assert post(engine.url + "/pause_generation", json={"mode": "in_place"}).json()["status"] == "ok"
    # Miles's pitfall avoided: relabel without aborting the requests the pause holds.
    post(engine.url + "/update_weight_version", json={"new_version": "v2", "abort_all_requests": False})
    time.sleep(0.3)
    assert thread.is_alive()  # held, not answered, not timed out
    with TitoClient(proxy.url, TOKEN) as tito:  # the driver sees the turn its pause holds, then sees it drain
        held = tito.info()["turns_in_flight"]
        assert held["count"] == 1 and held["oldest_s"] >= 0.3
        post(engine.url + "/continue_generation")
        thread.join(60)
        assert tito.info()["turns_in_flight"] == {"count": 0, "oldest_s": None}
    assert "error" not in out, out.get("error")
    (turn,) = turns(proxy.record_dir, "in-place")
    (only,) = engine.backend.generated_copy()
    assert only["completion_ids"] == turn.completion_ids and turn.resumed is None
    spans = turn.weight_version_spans
    assert spans is not None and [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["end"] >= 12 and spans[-1]["end"] == len(turn.completion_ids)


def test_aborting_the_first_attempts_rid_does_not_cut_the_resumed_one(proxy, engine) -> None:
    thread, out = during(ask, proxy, "rid-prefix", stream=False)
    cut_by(engine, "pause", 12)
    deadline = time.monotonic() + 20
    while len(engine.backend.generated_copy()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    first, second = engine.backend.generated_copy()
    sampled(engine, 3, rid=second["rid"])
    assert post(engine.url + "/abort_request", json={"rid": first["rid"]}).status_code == 200
    thread.join(60)
    assert "error" not in out, out.get("error")
    (turn,) = turns(proxy.record_dir, "rid-prefix")
    assert turn.resumed is not None and turn.resumed.attempts == 2
    assert len(engine.backend.generated_copy()) == 2


def test_past_the_resumption_cap_the_agent_gets_an_error_and_nothing_is_recorded(proxy, engine) -> None:
    thread, out = during(ask, proxy, "capped", stream=False)
    for count in range(1, 5):  # tito_resume_max is 3: the fourth cut is one too many
        deadline = time.monotonic() + 20
        while len(engine.backend.generated_copy()) < count:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        rid = engine.backend.generated_copy()[-1]["rid"]
        sampled(engine, 2, rid=rid)
        post(engine.url + "/abort_request", json={"rid": rid})
    thread.join(60)
    error = out.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    assert "tito_resume_max" in error.message
    assert turns(proxy.record_dir, "capped") == []
    assert len(engine.backend.generated_copy()) == 4


def test_a_resumed_turn_replays_and_redrives_as_one_turn(proxy, engine, tmp_path) -> None:
    messages = [{"role": "user", "content": "What is the weather in Lyon, replayed?"}]
    thread, out = during(ask, proxy, "replayed", stream=False, tools=True, messages=messages)
    cut_by(engine, "pause", 12)
    thread.join(60)
    assert "error" not in out, out.get("error")
    (turn,) = turns(proxy.record_dir, "replayed")
    assert turn.resumed is not None and turn.resumed.attempts == 2
    # Replay serves the stitched answer with no backend, as one recorded turn.
    with replay_proxy(proxy.record_dir, tmp_path) as replayer:
        again = ask(replayer, "replayed-again", stream=False, tools=True, messages=messages)
    assert answer_of(again) == answer_of(out["value"])
    # Re-drive scores the whole completion in one request: the prompt and both attempts' tokens.
    engine.backend.reset()
    engine.backend.scored.clear()
    redrive(proxy.record_dir, engine.url, tmp_path / "redrive.json")
    whole = turn_prompt(proxy.record_dir, "replayed") + turn.completion_ids
    assert [body["input_ids"] for body in engine.backend.scored].count(whole) == 1


def turn_prompt(record_dir: Path, session: str) -> list[int]:
    found = read_session(record_dir, session)
    assert found is not None
    (prompt, _completion) = found.full_ids()[0]
    return prompt


def test_an_abort_with_an_error_status_is_the_servers_error_and_is_not_resumed(proxy, engine) -> None:
    engine.backend.set_faults(["http503"])  # what sglang answers for an abort it gives a status (its own timeouts)
    with pytest.raises(openai.APIStatusError) as caught:
        ask(proxy, "error-abort", stream=False)
    assert caught.value.status_code == 503
    assert len(engine.backend.received_copy()) == 1 and turns(proxy.record_dir, "error-abort") == []


def test_an_agent_that_leaves_during_the_pause_is_neither_resumed_nor_recorded(proxy, engine) -> None:
    thread, out = during(ask, proxy, "left", stream=False, timeout=3)
    sampled(engine, 12)
    assert post(engine.url + "/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"
    thread.join(30)  # the agent's client gives up while its resubmitted generation waits for the resume
    assert isinstance(out.get("error"), openai.APITimeoutError)
    time.sleep(0.5)
    post(engine.url + "/continue_generation")
    time.sleep(1.0)
    assert turns(proxy.record_dir, "left") == []
    with TitoClient(proxy.url, TOKEN) as tito:
        assert tito.info()["generations_cut"]["resuming"] == 0
    assert len(engine.backend.generated_copy()) == 1, "the resubmission left with its agent"


@pytest.fixture(scope="module")
def bounded(sglang, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("bounded")
    options = {"tito_backend_kind": "sglang", "tito_resume_max": "10", "tito_resume_wait": "1"}
    with Mitmdump(
        sglang.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent, options=options
    ) as running:
        running.record_dir = record_dir
        yield running


def test_a_generation_cut_again_past_the_wait_bound_is_an_error_and_nothing_is_recorded(bounded, engine) -> None:
    thread, out = during(ask, bounded, "overdue", stream=False)
    sampled(engine, 12)
    assert post(engine.url + "/pause_generation", json={"mode": "abort"}).json()["status"] == "ok"  # the first cut
    time.sleep(1.2)  # the resubmission is held, past tito_resume_wait (1 s)
    post(engine.url + "/continue_generation")
    second = sampled(engine, 2)
    post(engine.url + "/abort_request", json={"rid": second})  # cut again: no attempt may start now
    thread.join(60)
    error = out.get("error")
    assert isinstance(error, openai.APIStatusError) and error.status_code == 503
    assert "tito_resume_wait" in error.message
    assert turns(bounded.record_dir, "overdue") == [] and len(engine.backend.generated_copy()) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_that_straddles_the_cut_ends_the_generation_there(proxy, engine, stream) -> None:
    """Each engine request checks its stop strings over its own output, so one that began before the cut and ends
    after it stops neither: the proxy finds it over the stitched text and ends the generation where the uncut
    generation stops."""
    ask(proxy, f"plain-{stream}", stream=False)
    (plain,) = turns(proxy.record_dir, f"plain-{stream}")
    tok, ids, at = engine.backend.tokenizer, plain.completion_ids, 20
    head = tok.decode(ids[: at - 3])
    # Around the cut, which falls exactly at `at`: the engine stalls there until the pause (`EnginePause.stall_at`;
    # a fixed pace raced the test thread on a loaded machine, and the cut once landed past the stop string's end).
    stop = tok.decode(ids[: at + 15])[len(head) :]
    assert tok.decode(ids).find(stop) == len(head)
    uncut_answer = ask(proxy, f"uncut-stop-{stream}", stream=stream, stop=[stop])
    (uncut,) = turns(proxy.record_dir, f"uncut-stop-{stream}")
    assert uncut.finish_reason == "stop" and len(uncut.completion_ids) < len(ids)
    engine.backend.reset()

    engine.backend.pause.stall_at = at  # the first request samples no further than `at` until the pause cuts it
    thread, out = during(ask, proxy, f"stop-{stream}", stream=stream, stop=[stop])
    cut_by(engine, "pause", at)
    thread.join(60)
    assert "error" not in out, out.get("error")
    (turn,) = turns(proxy.record_dir, f"stop-{stream}")
    first, second = engine.backend.generated_copy()
    cut = len(first["completion_ids"])
    assert cut == at and turn.resumed is not None and turn.resumed.cuts == [cut]
    assert len(second["completion_ids"]) > len(uncut.completion_ids) - cut  # the engine did not see the stop
    assert turn.completion_ids == uncut.completion_ids and turn.finish_reason == "stop"
    assert turn.completion_logprobs == uncut.completion_logprobs
    answer = answer_of(out["value"])
    if not stream:
        assert answer == answer_of(uncut_answer)
    else:  # the part of the stop string sampled before the cut had been streamed: the agent keeps it, no more
        reasoning = uncut_answer.get("reasoning_content") or (uncut_answer.get("model_extra") or {}).get(
            "reasoning_content"
        )
        assert answer["reasoning"].startswith(reasoning) and len(answer["reasoning"]) < len(reasoning) + len(stop)
        assert answer["finish_reason"] == "stop"
        recorded = answer_of({**turn.assistant_message, "finish_reason": turn.finish_reason})
        assert recorded == answer  # the record says what the agent has
