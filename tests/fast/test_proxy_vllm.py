"""Integration: the openai SDK -> a real mitmdump with `tito_backend_kind=vllm` -> the vLLM replica.

Runs against both wire generations the replica speaks (0.24.0 and 0.32.0). A tap between the proxy and the
replica records every call as it crossed the wire, so each forcing and rewrite is asserted on real bodies.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import openai
import pytest
from support.basics import TOOLS, cached_engine, tokenizer_path
from support.proxy_harness import Mitmdump, post, vllm_proxy
from support.seed_reference import expected_seed
from support.upstream_tap import UpstreamTap

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

MODEL = "tiny-qwen3"
RENDER, GENERATE, DERENDER = "/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"


class Stack:
    """replica <- tap <- mitmdump, plus where the proxy records."""

    def __init__(self, replica: VllmReplicaThread, tap: UpstreamTap, proxy: Mitmdump, record_dir: Path) -> None:
        self.replica, self.tap, self.proxy, self.record_dir = replica, tap, proxy, record_dir

    def reset(self) -> None:
        self.replica.backend.reset()
        self.tap.calls.clear()

    def client(self, session: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session}, max_retries=0
        )

    def records(self, session: str):
        path = self.record_dir / session_file_name(session)
        if not path.exists():
            return [], {}
        recorded = read_session_file(path)
        return recorded.turns, recorded.full_ids()

    def paths(self) -> list[str]:
        return [c["path"] for c in self.tap.calls if c["method"] == "POST"]


@pytest.fixture(scope="module", params=["0.32.0", "0.24.0"])
def stack(request, tmp_path_factory):
    version = request.param
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), version=version)
    record_dir = tmp_path_factory.mktemp(f"rec-{version}")
    with VllmReplicaThread(config) as replica, UpstreamTap(replica.url) as tap:
        with Mitmdump(
            tap.url,
            tokenizer=tokenizer_path("qwen3"),
            record_dir=record_dir,
            cwd=record_dir.parent,
            options={"tito_backend_kind": "vllm", "tito_upstream_timeout": "3"},
        ) as proxy:
            yield Stack(replica, tap, proxy, record_dir)


@pytest.fixture
def vllm(stack: Stack) -> Stack:
    stack.reset()
    return stack


def sid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def echo(message, reasoning: str = "drop") -> dict:
    out: dict = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls]
    value = (message.model_extra or {}).get("reasoning")
    if reasoning == "verbatim" and value:
        out["reasoning"] = value
    if reasoning == "renamed" and value:
        out["reasoning_content"] = value
    return out


def first_turn(vllm: Stack, session: str, **kw):
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    reply = vllm.client(session).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kw)
    return messages, reply


def test_generate_runs_on_our_ids_and_turn_two_extends_turn_one(vllm: Stack) -> None:
    session = sid("flow")
    messages, reply = first_turn(vllm, session)
    call = reply.choices[0].message.tool_calls[0]
    messages += [echo(reply.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "21C"}]
    vllm.client(session).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    turns, ids = vllm.records(session)
    assert [t.parent_turn_id for t in turns] == [None, 0], "an echoed assistant must not start a branch"
    generates = vllm.tap.of(GENERATE)
    generated = vllm.replica.generated()
    for turn, call_ in enumerate(generates):
        prompt, completion = ids[turn]
        assert call_["request"]["token_ids"] == prompt
        assert generated[turn]["prompt_ids"] == prompt and generated[turn]["completion_ids"] == completion
        assert call_["response"]["choices"][0]["token_ids"] == completion
    assert ids[1][0][: len(ids[0][0]) + len(ids[0][1])] == ids[0][0] + ids[0][1]
    assert vllm.paths() == [RENDER, GENERATE, DERENDER] * 2


def test_forced_fields_on_each_call(vllm: Stack) -> None:
    session = sid("forced")
    first_turn(vllm, session, stream=False, stream_options=None, top_logprobs=None)
    render = vllm.tap.of(RENDER)[0]["request"]
    assert render["stream"] is False and render["logprobs"] is True and render["top_logprobs"] == 0
    assert "stream_options" not in render and "input_ids" not in render
    rendered = vllm.tap.of(RENDER)[0]["response"]
    generate = vllm.tap.of(GENERATE)[0]["request"]
    assert generate["stream"] is False and "stream_options" not in generate
    assert generate["sampling_params"] == rendered["sampling_params"]
    turns, ids = vllm.records(session)
    assert generate["token_ids"] == ids[0][0]
    derender = vllm.tap.of(DERENDER)[0]["request"]
    assert derender["model"] == MODEL and derender["prompt_tokens"] == len(ids[0][0])
    assert derender["chat_request"]["tools"] == TOOLS
    generated = vllm.tap.of(GENERATE)[0]["response"]
    if vllm.replica.backend.v32:
        # 0.32+: derender gets a seed of the prompt (in the generate response's echo too) and no messages.
        seed = expected_seed(ids[0][0], cached_engine("qwen3").special_ids)
        assert generate["return_token_ids"] is True and derender["prompt_token_ids"] == seed
        assert derender["generate_response"] == {**generated, "prompt_token_ids": seed}
        assert derender["chat_request"]["messages"] == [{"role": "user", "content": ""}]
        assert {k: v for k, v in derender["chat_request"].items() if k != "messages"} == {
            k: v for k, v in render.items() if k != "messages"
        }
        assert turns[0].backend_version == "0.32.0"
    else:
        assert "return_token_ids" not in generate and "prompt_token_ids" not in derender
        assert derender["generate_response"] == generated
        assert derender["chat_request"]["messages"][-1]["content"] == "Weather in Paris?"
        assert turns[0].backend_version == "0.24.0"
    assert turns[0].render_skew == {"equal": True, "first_divergence": None}


def test_streamed_agent_request_streams_live_only_where_vllm_can(vllm: Stack) -> None:
    session = sid("stream")
    messages = [{"role": "user", "content": "Tell me about Oslo."}]
    with vllm.client(session).chat.completions.stream(model=MODEL, messages=messages) as events:
        for _ in events:
            pass
        final = events.get_final_completion()
    assert final.choices[0].message.content or (final.choices[0].message.model_extra or {}).get("reasoning")
    assert vllm.tap.of(RENDER)[0]["request"]["stream"] is False
    live = vllm.replica.backend.v32  # 0.31+ streams generate and derender; 0.24 gets a re-framed whole turn
    assert vllm.tap.of(GENERATE)[0]["request"]["stream"] is live
    turns, _ = vllm.records(session)
    assert len(turns) == 1


def test_top_logprobs_kept_when_the_agent_asks(vllm: Stack) -> None:
    first_turn(vllm, sid("top5"), logprobs=True, top_logprobs=5)
    assert vllm.tap.of(RENDER)[0]["request"]["top_logprobs"] == 5


def test_tool_call_finish_reason_is_rewritten_on_the_wire_and_in_the_record(vllm: Stack) -> None:
    session = sid("toolcall")
    _, reply = first_turn(vllm, session)
    assert reply.choices[0].message.tool_calls
    assert vllm.tap.of(DERENDER)[0]["response"]["choices"][0]["finish_reason"] == "stop"
    assert reply.choices[0].finish_reason == "tool_calls"
    turns, _ = vllm.records(session)
    assert turns[0].finish_reason == "tool_calls"


def test_eos_text_is_removed_from_content(vllm: Stack) -> None:
    session = sid("eos")
    messages, reply = first_turn(vllm, session)
    call = reply.choices[0].message.tool_calls[0]
    messages += [echo(reply.choices[0].message), {"role": "tool", "tool_call_id": call.id, "content": "21C"}]
    answer = vllm.client(session).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    wire = vllm.tap.of(DERENDER)[1]["response"]["choices"][0]["message"]["content"]
    assert wire.endswith("<|im_end|>"), "the replica reproduces derender's trailing stop text"
    assert answer.choices[0].message.content == wire[: -len("<|im_end|>")]
    turns, _ = vllm.records(session)
    assert turns[1].assistant_message["content"] == wire[: -len("<|im_end|>")]


def test_an_unmodified_derender_body_reaches_the_agent_byte_for_byte(vllm: Stack) -> None:
    session = sid("bytes")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there."}], "max_tokens": 5, "logprobs": True}
    response = post(vllm.proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert response.status_code == 200
    message = json.loads(response.content)["choices"][0]["message"]
    assert json.loads(response.content)["choices"][0]["finish_reason"] == "length"
    assert response.content == vllm.tap.of(DERENDER)[0]["response_bytes"]
    # A thinking turn cut off by max_tokens is reasoning only: valid, served and recorded.
    assert message["reasoning"] and not message["content"] and not message.get("tool_calls")
    turns, ids = vllm.records(session)
    assert turns[0].finish_reason == "length" and len(ids[0][1]) == 5


def test_max_tokens_of_sixteen_is_put_back(vllm: Stack) -> None:
    for key in ("max_tokens", "max_completion_tokens"):
        vllm.reset()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count."}], key: 16}
        assert post(vllm.proxy.url + "/v1/chat/completions", json=body).status_code == 200
        if vllm.replica.backend.v32:
            assert "max_tokens" not in vllm.tap.of(RENDER)[0]["response"]["sampling_params"], "the render bug"
        assert vllm.tap.of(GENERATE)[0]["request"]["sampling_params"]["max_tokens"] == 16
        assert len(vllm.tap.of(GENERATE)[0]["response"]["choices"][0]["token_ids"]) <= 16


def test_missing_model_is_400_before_any_call_and_changes_nothing(vllm: Stack) -> None:
    session = sid("nomodel")
    messages, reply = first_turn(vllm, session)
    before = (vllm.record_dir / session_file_name(session)).read_bytes()
    vllm.reset()
    for request in ([{"role": "user", "content": "x"}], messages + [echo(reply.choices[0].message)]):
        response = post(
            vllm.proxy.url + "/v1/chat/completions", json={"messages": request}, headers={"x-session-id": session}
        )
        assert response.status_code == 400 and "model is required" in response.json()["error"]["message"]
    # A diverging retry without model: still nothing.
    diverging = messages[:1] + [{"role": "user", "content": "Weather in Rome?"}]
    assert post(vllm.proxy.url + "/v1/chat/completions", json={"messages": diverging}).status_code == 400
    assert vllm.tap.calls == []
    assert (vllm.record_dir / session_file_name(session)).read_bytes() == before


@pytest.mark.parametrize("style", ["verbatim", "drop", "renamed"])
def test_reasoning_echoed_in_any_dialect_extends_the_session(vllm: Stack, style: str) -> None:
    session = sid(f"reason-{style}")
    messages = [{"role": "user", "content": "Think about Lima."}]
    client = vllm.client(session)
    reply = client.chat.completions.create(model=MODEL, messages=messages)
    reasoning = (reply.choices[0].message.model_extra or {}).get("reasoning")
    assert reasoning, "the replica answers with reasoning"
    wire = vllm.tap.of(DERENDER)[0]["response"]["choices"][0]["message"]
    assert "reasoning" in wire and "reasoning_content" not in wire
    messages += [echo(reply.choices[0].message, style), {"role": "user", "content": "More."}]
    client.chat.completions.create(model=MODEL, messages=messages)
    turns, _ = vllm.records(session)
    assert [t.parent_turn_id for t in turns] == [None, 0]
    assert turns[0].assistant_message["reasoning_content"] == reasoning == turns[0].assistant_message["reasoning"]


@pytest.mark.parametrize(
    ("fault", "status", "calls"),
    [
        ("render:http400", 400, [RENDER]),
        ("generate:http500", 500, [RENDER, GENERATE]),
        ("derender:http503", 503, [RENDER, GENERATE, DERENDER]),
        ("generate:missing_ids", 502, [RENDER, GENERATE]),
        ("generate:empty_ids", 502, [RENDER, GENERATE]),
        ("generate:non_int_ids", 502, [RENDER, GENERATE]),
        ("generate:missing_logprobs", 502, [RENDER, GENERATE]),
        ("generate:logprobs_length", 502, [RENDER, GENERATE]),
        ("generate:not_json", 502, [RENDER, GENERATE]),
        ("derender:not_chat", 502, [RENDER, GENERATE, DERENDER]),
        ("derender:empty_message", 502, [RENDER, GENERATE, DERENDER]),
        ("generate:reset", 502, [RENDER, GENERATE]),
        ("generate:stall", 504, [RENDER, GENERATE]),
        ("render:reset_early", 502, [RENDER]),
        ("render:stall", 504, [RENDER]),
        ("generate:truncated_json", 502, [RENDER, GENERATE]),
        ("generate:short_prompt_ids", 502, [RENDER, GENERATE]),
        ("derender:reset", 502, [RENDER, GENERATE, DERENDER]),
        ("derender:truncated_json", 502, [RENDER, GENERATE, DERENDER]),
    ],
)
def test_upstream_faults_pass_through_or_502_and_record_nothing(vllm: Stack, fault, status, calls) -> None:
    if fault == "generate:short_prompt_ids" and vllm.replica.config.version < "0.30":
        pytest.skip("vLLM < 0.30 cannot echo the prompt ids it ran on")
    session = sid("fault")
    messages, reply = first_turn(vllm, session)
    size = (vllm.record_dir / session_file_name(session)).stat().st_size
    vllm.reset()
    vllm.replica.set_faults([fault])
    follow = messages + [echo(reply.choices[0].message), {"role": "user", "content": "And Oslo?"}]
    body = {"model": MODEL, "messages": follow, "tools": TOOLS}
    response = post(vllm.proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert response.status_code == status, response.text
    if fault.split(":")[1].startswith("http"):  # verbatim passthrough of the failing call's answer
        failing = [c for c in vllm.tap.calls if c["path"] == calls[-1]][-1]
        assert response.content == failing["response_bytes"]
    assert vllm.paths() == calls, "a failed call must stop the chain"
    assert (vllm.record_dir / session_file_name(session)).stat().st_size == size
    vllm.tap.calls.clear()
    vllm.client(session).chat.completions.create(model=MODEL, messages=follow, tools=TOOLS)
    turns, _ = vllm.records(session)
    assert [t.parent_turn_id for t in turns] == [None, 0]


def test_scale_out_disabled_names_the_flag(tmp_path: Path) -> None:
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), enable_scale_out=False)
    with (
        VllmReplicaThread(config) as replica,
        vllm_proxy(replica.url, tmp_path / "rec", tmp_path) as proxy,
    ):
        response = post(
            proxy.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert response.status_code == 502
        assert "--enable-scale-out" in response.json()["error"]["message"]
    assert not list((tmp_path / "rec").glob("*.jsonl"))
