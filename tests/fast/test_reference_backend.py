"""Tests for tito_addon.replicas.sglang_replica (the sglang replica) over the real Qwen3 tokenizer."""

from __future__ import annotations

import contextlib
import http.client as http_client
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.basics import REPO, wait_until

from tito_addon.replicas.sglang_cli import main
from tito_addon.replicas.sglang_replica import (
    FAULT_NAMES,
    ReferenceBackend,
    ReplicaConfig,
    ReplicaThread,
)

TOKENIZER_DIR = REPO.parent / "shared" / "tokenizers" / "qwen3"
IM_END = 151645

pytestmark = pytest.mark.skipif(not TOKENIZER_DIR.is_dir(), reason=f"tokenizer missing: {TOKENIZER_DIR}")

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]


# ------------------------------------------------------------------------------ fixtures/helpers


@pytest.fixture(scope="module")
def _replica_module() -> Iterator[ReplicaThread]:
    with ReplicaThread(ReplicaConfig(tokenizer=str(TOKENIZER_DIR))) as r:
        yield r


@pytest.fixture()
def replica(_replica_module: ReplicaThread) -> ReplicaThread:
    _replica_module.clear()
    return _replica_module


@pytest.fixture(scope="module")
def old_replica() -> Iterator[ReplicaThread]:
    with ReplicaThread(ReplicaConfig(tokenizer=str(TOKENIZER_DIR), honor_input_ids=False)) as r:
        yield r


@pytest.fixture(scope="module")
def tok(_replica_module: ReplicaThread) -> Any:
    return _replica_module.backend.tokenizer.tok


def http(url: str, body: Any = None, *, method: str | None = None, raw: bytes | None = None, timeout: float = 10):
    """Return (status, parsed-or-raw body, raw bytes)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    try:
        parsed = json.loads(payload)
    except ValueError:
        parsed = None
    return status, parsed, payload


def chat(r: ReplicaThread, body: dict[str, Any], **kw: Any):
    return http(r.url + "/v1/chat/completions", body, **kw)


def tito_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "default",
        "messages": messages,
        "logprobs": True,
        "return_meta_info": True,
        "return_prompt_token_ids": True,
    }
    body.update(extra)
    return body


def render_ids(tok: Any, messages: list[dict[str, Any]], tools: Any = None, **kwargs: Any) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    return tok.encode(text, add_special_tokens=False)


def completion_ids(resp: dict[str, Any]) -> list[int]:
    return [e[1] for e in resp["choices"][0]["meta_info"]["output_token_logprobs"]]


USER = [{"role": "user", "content": "What is the weather in Paris today?"}]


# ------------------------------------------------------------------------------ basics


def test_health_models_and_server_info(replica: ReplicaThread) -> None:
    assert http(replica.url + "/health")[:2] == (200, {"status": "ok"})
    status, models, _ = http(replica.url + "/v1/models")
    assert status == 200 and models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["reference-model"]
    status, info, _ = http(replica.url + "/get_server_info")
    assert status == 200 and info["version"] == "0.5.23"


def test_input_ids_honoured_and_echoed(replica: ReplicaThread, tok: Any) -> None:
    prompt = render_ids(tok, [{"role": "user", "content": "Say hello to Tokyo"}])
    body = tito_body([{"role": "user", "content": "placeholder"}], input_ids=prompt)
    status, out, _ = chat(replica, body)
    assert status == 200
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert choice["meta_info"]["prompt_tokens"] == len(prompt) == out["usage"]["prompt_tokens"]
    assert replica.received()[-1]["input_ids"] == prompt
    # without input_ids the replica renders `messages` itself
    status, out2, _ = chat(replica, tito_body([{"role": "user", "content": "placeholder"}]))
    assert out2["choices"][0]["prompt_token_ids"] == render_ids(tok, [{"role": "user", "content": "placeholder"}])


def test_response_shape_and_ids(replica: ReplicaThread, tok: Any) -> None:
    status, out, _ = chat(replica, tito_body(USER, model="my-model", return_token_ids=True))
    assert status == 200
    assert len(out["id"]) == 32 and int(out["id"], 16) >= 0
    assert out["object"] == "chat.completion" and out["model"] == "my-model"
    choice = out["choices"][0]
    meta = choice["meta_info"]
    ids = completion_ids(out)
    assert ids[-1] == IM_END and choice["finish_reason"] == "stop" and choice["matched_stop"] == IM_END
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert meta["id"] == out["id"] and meta["cached_tokens"] >= 0 and meta["weight_version"] == "default"
    assert meta["completion_tokens"] == len(ids) == out["usage"]["completion_tokens"]
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + len(ids)
    assert choice["response_token_ids"] == ids
    # meta token texts and OpenAI-style logprobs
    assert [e[2] for e in meta["output_token_logprobs"]] == [tok.decode([i]) for i in ids]
    lps = choice["logprobs"]["content"]
    assert len(lps) == len(ids)
    for entry, (lp, _tid, text) in zip(lps, meta["output_token_logprobs"], strict=True):
        assert entry["logprob"] == lp and entry["token"] == text and entry["bytes"] == list(text.encode())
        assert math.isfinite(lp) and -6 < lp <= 0
    # the message is what sglang's parsers derive from the decoded ids
    msg = choice["message"]
    text = tok.decode(ids[:-1])
    assert text.startswith("<think>") and "</think>" in text
    assert msg["reasoning_content"] == text[len("<think>") : text.index("</think>")]
    assert msg["content"] == text[text.index("</think>") + len("</think>") :]
    assert "Turn 1" in msg["content"] and "°C" in msg["content"] and "café" in msg["content"]
    assert msg["tool_calls"] is None
    assert meta["reasoning_tokens"] == ids.index(tok.convert_tokens_to_ids("</think>")) + 1
    # determinism of the scripted model (text and logprobs)
    _, again, _ = chat(replica, tito_body(USER, model="my-model"))
    assert completion_ids(again) == ids
    assert again["choices"][0]["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]


def test_flags_absent_means_fields_absent(replica: ReplicaThread) -> None:
    status, out, _ = chat(replica, {"messages": USER})
    choice = out["choices"][0]
    assert status == 200 and out["model"] == "reference-model"
    assert choice["logprobs"] is None
    for key in ("meta_info", "prompt_token_ids", "response_token_ids"):
        assert key not in choice
    assert "sglext" not in out


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"tools": WEATHER_TOOLS},
        {"tools": WEATHER_TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
    ],
    ids=["text", "text-nothink", "tool", "tool-nothink"],
)
def test_noncanonical_split_present(replica: ReplicaThread, tok: Any, extra: dict[str, Any]) -> None:
    status, out, _ = chat(replica, tito_body(USER, **extra))
    ids = completion_ids(out)
    text = tok.decode(ids)
    canonical = tok.encode(text, add_special_tokens=False)
    assert ids != canonical, "replica should emit a non-canonical split"
    assert tok.decode(canonical) == text
    assert len(ids) > len(canonical)  # a split adds one id per split
    assert len(ids) - len(canonical) in (1, 2)


@pytest.mark.asyncio
async def test_canonical_mode_and_latency_async() -> None:
    backend = ReferenceBackend(ReplicaConfig(tokenizer=str(TOKENIZER_DIR), noncanonical=False, latency_s=0.2))
    port = await backend.start()
    try:
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=tito_body(USER)) as resp:
                out = await resp.json()
            assert time.monotonic() - t0 >= 0.2
        ids = completion_ids(out)
        tok = backend.tokenizer.tok
        assert ids == tok.encode(tok.decode(ids), add_special_tokens=False)
        assert len(backend.received) == 1
    finally:
        await backend.stop()


def test_old_sglang_ignores_token_fields(old_replica: ReplicaThread, tok: Any) -> None:
    old_replica.clear()
    messages = [{"role": "user", "content": "Tell me about Lisbon"}]
    bogus = render_ids(tok, [{"role": "user", "content": "something else entirely, much longer " * 5}])
    status, out, _ = chat(old_replica, tito_body(messages, input_ids=bogus, return_token_ids=True))
    assert status == 200
    choice = out["choices"][0]
    assert "meta_info" not in choice and "prompt_token_ids" not in choice and "response_token_ids" not in choice
    assert out["usage"]["prompt_tokens"] == len(render_ids(tok, messages)) != len(bogus)
    assert choice["logprobs"] is not None  # plain OpenAI logprobs still work
    # old servers did not reject the streaming + token-field combination
    status, _, raw = chat(old_replica, tito_body(messages, stream=True))
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]")
    status, info, _ = http(old_replica.url + "/get_server_info")
    assert info["version"] == "0.5.12"


# ------------------------------------------------------------------------------ scripted turns


def test_tool_call_turn(replica: ReplicaThread, tok: Any) -> None:
    status, out, _ = chat(replica, tito_body(USER, tools=WEATHER_TOOLS))
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    assert choice["meta_info"]["finish_reason"] == {"type": "tool_calls", "matched": None}
    assert msg["content"] is None and msg["reasoning_content"]
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 5 + 24
    assert call["index"] == 0 and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args == {"city": "Paris", "days": 1, "metric": True}
    ids = completion_ids(out)
    assert ids[-1] == IM_END
    text = tok.decode(ids[:-1])
    expected = '<tool_call>\n{"name": "get_weather", "arguments": ' + call["function"]["arguments"] + "}\n</tool_call>"
    assert text.endswith("</think>\n\n" + expected)
    # prompt rendered with the tools section
    assert "<tools>" in tok.decode(choice["prompt_token_ids"])


def test_parallel_tool_calls_every_third_turn(replica: ReplicaThread, tok: Any) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 °C"},
        {"role": "assistant", "content": "It is 18 °C."},
        {"role": "user", "content": "And what about Oslo and the time there?"},
    ]
    status, out, _ = chat(replica, tito_body(messages, tools=WEATHER_TOOLS))
    assert status == 200
    msg = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert [c["index"] for c in msg["tool_calls"]] == [0, 1]
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    assert msg["content"]  # parallel turn carries a short content before the calls
    text = tok.decode(completion_ids(out)[:-1])
    assert text.count("<tool_call>") == 2 and "\n<tool_call>" in text


def test_answer_after_tool_result(replica: ReplicaThread) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    status, out, _ = chat(replica, tito_body(messages, tools=WEATHER_TOOLS))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] is None
    assert "Turn 2" in choice["message"]["content"]
    assert "The tool returned" in choice["message"]["reasoning_content"]


def test_steering_picks_the_tool_and_bounds_the_rounds() -> None:
    """`preferred_tools` calls the named tool (the knob's order; names not offered are skipped) with its fixed
    arguments, parallel calls included; `tool_rounds` calls tools for N assistant turns after the user's prompt,
    whatever comes last (here a system message after the prompt, as Claude Code sends), then answers."""
    preferred = {"not_offered": {"x": 1}, "get_time": {"city": "Lima"}, "get_weather": {"city": "Oslo"}}
    config = ReplicaConfig(tokenizer=str(TOKENIZER_DIR), preferred_tools=preferred, tool_rounds=3)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What time is it in Lima?"},
        {"role": "system", "content": "Working directory: /tmp"},
    ]
    with ReplicaThread(config) as steered:
        for turn in (1, 2, 3):
            status, out, _ = chat(steered, tito_body(messages, tools=WEATHER_TOOLS))
            assert status == 200
            message = out["choices"][0]["message"]
            calls = message["tool_calls"]
            # Every third turn is the script's parallel turn: the steered tool twice, never made-up arguments.
            assert [c["function"]["name"] for c in calls] == ["get_time"] * (2 if turn == 3 else 1)
            assert all(json.loads(c["function"]["arguments"]) == {"city": "Lima"} for c in calls)
            messages.append({"role": "assistant", "content": message["content"], "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": "12:00"} for c in calls]
        status, out, _ = chat(steered, tito_body(messages, tools=WEATHER_TOOLS))
        assert out["choices"][0]["finish_reason"] == "stop" and out["choices"][0]["message"]["tool_calls"] is None
        # A new prompt starts a new count.
        messages += [{"role": "assistant", "content": "Noon."}, {"role": "user", "content": "And now?"}]
        status, out, _ = chat(steered, tito_body(messages, tools=WEATHER_TOOLS))
        assert out["choices"][0]["finish_reason"] == "tool_calls"


def test_thinking_off(replica: ReplicaThread, tok: Any) -> None:
    body = tito_body(USER, chat_template_kwargs={"enable_thinking": False})
    status, out, _ = chat(replica, body)
    choice = out["choices"][0]
    assert choice["message"]["reasoning_content"] is None
    assert choice["message"]["content"].startswith("Turn 1")
    assert choice["meta_info"]["reasoning_tokens"] == 0
    assert "<think>" not in tok.decode(completion_ids(out))
    assert tok.decode(choice["prompt_token_ids"]).endswith("<think>\n\n</think>\n\n")


def test_finish_length_inside_think(replica: ReplicaThread, tok: Any) -> None:
    status, out, _ = chat(replica, tito_body(USER, max_tokens=6))
    choice = out["choices"][0]
    ids = completion_ids(out)
    assert len(ids) == 6 and IM_END not in ids
    assert choice["finish_reason"] == "length" and choice["matched_stop"] is None
    assert choice["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert choice["meta_info"]["completion_tokens"] == 6
    msg = choice["message"]
    assert msg["content"] is None and msg["tool_calls"] is None
    assert msg["reasoning_content"] == tok.decode(ids)[len("<think>") :]


def test_finish_length_inside_tool_call(replica: ReplicaThread, tok: Any) -> None:
    _, full, _ = chat(replica, tito_body(USER, tools=WEATHER_TOOLS))
    n = len(completion_ids(full)) - 5
    status, out, _ = chat(replica, tito_body(USER, tools=WEATHER_TOOLS, max_completion_tokens=n))
    choice = out["choices"][0]
    assert completion_ids(out) == completion_ids(full)[:n]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == full["choices"][0]["message"]["reasoning_content"]


def test_prefix_cache_rewards_exact_ids(replica: ReplicaThread, tok: Any) -> None:
    prompt = render_ids(tok, USER)
    _, first, _ = chat(replica, tito_body(USER, input_ids=prompt))
    assert first["choices"][0]["meta_info"]["cached_tokens"] == 0
    history = prompt + completion_ids(first)
    follow = history + tok.encode(
        "\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    _, second, _ = chat(replica, tito_body(USER, input_ids=follow))
    assert second["choices"][0]["meta_info"]["cached_tokens"] == len(history)


def test_sglext_ids(replica: ReplicaThread) -> None:
    body = {"messages": USER, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    _, out, _ = chat(replica, body)
    assert out["sglext"]["input_ids"] and out["sglext"]["output_ids"][0][-1] == IM_END
    _, _, raw = chat(replica, dict(body, stream=True))
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    ext = [c for c in chunks if "sglext" in c]
    assert len(ext) == 1 and ext[0]["sglext"]["output_ids"] == out["sglext"]["output_ids"]


# ------------------------------------------------------------------------------ streaming


def _collect_stream(raw: bytes) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = [ln for ln in raw.decode().split("\n\n") if ln.strip()]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: ") :]) for ln in lines[:-1]]
    msg: dict[str, Any] = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for c in chunks:
        for ch in c["choices"]:
            d = ch["delta"]
            for key in ("reasoning_content", "content"):
                if d.get(key):
                    msg[key] += d[key]
            for tc in d.get("tool_calls") or []:
                slot = msg["tool_calls"].setdefault(tc["index"], {"name": "", "arguments": "", "id": None})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
    return chunks, msg


@pytest.mark.parametrize("tools", [None, WEATHER_TOOLS])
def test_stream_matches_non_stream(replica: ReplicaThread, tools: Any) -> None:
    base: dict[str, Any] = {"messages": USER, "logprobs": True}
    if tools:
        base["tools"] = tools
    _, full, _ = chat(replica, base)
    status, _, raw = chat(replica, dict(base, stream=True, stream_options={"include_usage": True}))
    assert status == 200
    chunks, msg = _collect_stream(raw)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finish = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    ref = full["choices"][0]
    assert len(finish) == 1 and finish[0]["finish_reason"] == ref["finish_reason"]
    assert finish[0]["matched_stop"] == ref["matched_stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert msg["reasoning_content"] == ref["message"]["reasoning_content"]
    assert (msg["content"] or None) == ref["message"]["content"]
    want_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in ref["message"]["tool_calls"] or []]
    assert [(v["name"], v["arguments"]) for _, v in sorted(msg["tool_calls"].items())] == want_calls
    streamed_lps = [
        e for c in chunks if c["choices"] for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])
    ]
    assert [e["logprob"] for e in streamed_lps] == [e["logprob"] for e in ref["logprobs"]["content"]]


def test_stream_rejects_token_fields(replica: ReplicaThread) -> None:
    for flag in ("return_meta_info", "return_prompt_token_ids", "return_token_ids"):
        status, out, _ = chat(replica, {"messages": USER, "stream": True, flag: True})
        assert status == 400 and out["object"] == "error" and out["code"] == 400
        assert flag in out["message"]


# ------------------------------------------------------------------------------ validation


def test_bad_requests(replica: ReplicaThread) -> None:
    status, out, _ = chat(replica, None, raw=b"{not json")
    assert status == 400 and out["type"] == "BadRequestError" and out["code"] == 400
    for body in ({"model": "x"}, {"messages": []}):
        status, out, _ = chat(replica, body)
        assert status == 400 and out["message"] == "Messages cannot be empty."
        assert out["object"] == "error"
    status, out, _ = chat(replica, {"messages": USER, "input_ids": [1, -5]})
    assert status == 400


# ------------------------------------------------------------------------------ faults


def test_fault_queue_is_fifo_and_validated(replica: ReplicaThread) -> None:
    with pytest.raises(ValueError):
        replica.set_faults(["bogus"])
    replica.set_faults(["none", "http500"])
    assert chat(replica, {"messages": USER})[0] == 200
    assert chat(replica, {"messages": USER})[0] == 500
    assert chat(replica, {"messages": USER})[0] == 200
    assert len(replica.received()) == 3


@pytest.mark.parametrize("fault", sorted(FAULT_NAMES - {"none", "stall", "reset", "reset_early"}))
def test_each_fault(replica: ReplicaThread, tok: Any, fault: str) -> None:
    replica.set_faults([fault])
    prompt = render_ids(tok, USER)
    status, out, raw = chat(replica, tito_body(USER, input_ids=prompt))
    assert len(replica.received()) == 1
    if fault in ("http500", "http429", "http503"):
        code = int(fault[4:])
        assert status == code and out == {"object": "error", "message": "injected", "code": code}
    elif fault == "not_json":
        assert status == 200 and raw == b"{weird"
    elif fault == "truncated_json":
        assert status == 200 and out is None and raw.startswith(b'{"id": "cut"')
    elif fault == "wrong_prompt_tokens":
        assert out["choices"][0]["meta_info"]["prompt_tokens"] == len(prompt) + 1
    elif fault == "no_choices":
        assert status == 200 and out["choices"] == []
    elif fault == "no_meta_info":
        assert out["choices"][0]["meta_info"] is None
    elif fault == "length_mismatch":
        meta = out["choices"][0]["meta_info"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - 1
    elif fault == "empty_message":
        msg = out["choices"][0]["message"]
        assert msg["content"] is None and msg["tool_calls"] is None and msg["reasoning_content"] is None
    elif fault == "wrong_prompt_ids":
        echoed = out["choices"][0]["prompt_token_ids"]
        assert echoed[:-1] == prompt[:-1] and echoed[-1] != prompt[-1]
    elif fault == "nan_logprob":
        assert b"NaN" in raw
        lps = out["choices"][0]["meta_info"]["output_token_logprobs"]
        assert sum(1 for e in lps if math.isnan(e[0])) == 1
    else:  # pragma: no cover
        pytest.fail(f"untested fault {fault}")
    # the fault was consumed: the next request is healthy
    status, ok, _ = chat(replica, tito_body(USER, input_ids=prompt))
    assert status == 200 and ok["choices"][0]["meta_info"]["completion_tokens"] == len(completion_ids(ok))


def test_fault_reset_and_stall(replica: ReplicaThread) -> None:
    replica.set_faults(["reset", "reset_early", "stall"])
    for _ in range(2):
        with pytest.raises((OSError, http_client.HTTPException)):
            chat(replica, {"messages": USER})
    with pytest.raises((OSError, http_client.HTTPException)):  # TimeoutError is an OSError
        chat(replica, {"messages": USER}, timeout=0.5)
    assert len(replica.received()) == 3
    assert chat(replica, {"messages": USER})[0] == 200


def test_control_endpoints(replica: ReplicaThread) -> None:
    status, out, _ = http(replica.url + "/_replica/faults", {"faults": ["http429"]})
    assert status == 200 and out == {"faults": ["http429"]}
    assert http(replica.url + "/_replica/faults", {"faults": ["nope"]})[0] == 400
    assert chat(replica, {"messages": USER})[0] == 429
    status, reqs, _ = http(replica.url + "/_replica/requests")
    assert status == 200 and reqs == [{"messages": USER}]
    assert http(replica.url + "/_replica/generated")[:2] == (200, [])  # a refused request generated nothing
    assert chat(replica, {"messages": USER})[0] == 200
    status, generated, _ = http(replica.url + "/_replica/generated")
    assert status == 200 and generated == replica.generated() and len(generated) == 1
    assert generated[0]["prompt_ids"] and generated[0]["completion_ids"]
    replica.set_faults(["http500"])
    assert http(replica.url + "/_replica/reset", {})[0] == 200
    assert replica.received() == [] and replica.backend.pending_faults() == []
    assert chat(replica, {"messages": USER})[0] == 200


# ------------------------------------------------------------------------------ openai SDK + CLI


def test_openai_sdk_roundtrip(replica: ReplicaThread, tok: Any) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=replica.url + "/v1", api_key="x", max_retries=0)
    prompt = render_ids(tok, USER, tools=WEATHER_TOOLS)
    resp = client.chat.completions.create(
        model="default",
        messages=USER,
        tools=WEATHER_TOOLS,
        logprobs=True,
        extra_body={"input_ids": prompt, "return_meta_info": True, "return_prompt_token_ids": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    extra = choice.model_extra or {}
    assert extra["prompt_token_ids"] == prompt
    assert extra["meta_info"]["completion_tokens"] == len(extra["meta_info"]["output_token_logprobs"])
    stream = client.chat.completions.create(model="default", messages=USER, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Turn 1" in text


@contextlib.contextmanager
def served(tmp_path: Path, argv: list[str]) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """The reference backend as a process on a free port: (process, port)."""
    port_file = tmp_path / "port"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv, "--tokenizer", str(TOKENIZER_DIR), "--port", "0", "--port-file", str(port_file)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        started = wait_until(lambda: port_file.exists() or proc.poll() is not None)
        assert started and port_file.exists(), proc.stderr.read() if proc.poll() is not None else "no port file"
        yield proc, int(port_file.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_serves_and_exits_on_sigterm(tmp_path: Path) -> None:
    with served(tmp_path, ["tito_addon.replicas.sglang_replica"]) as (proc, port):
        assert http(f"http://127.0.0.1:{port}/health")[:2] == (200, {"status": "ok"})
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
        assert proc.returncode == 0
        assert f"reference backend listening on http://127.0.0.1:{port}" in out


def test_cli_flags_script_an_agents_own_tool_for_n_rounds_then_an_answer(tmp_path: Path) -> None:
    """`reference-backend --call-tool NAME=JSON --tool-rounds N`: what a CLI capture needs (its shell tool, called
    with fixed arguments N times per prompt, then an answer), from the command line alone."""
    tools = [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
        for name in ("Read", "Bash")
    ]
    command = {"command": "echo tito-ok", "description": "Print a marker"}
    script = ["--call-tool", "Missing={}", "--call-tool", f"Bash={json.dumps(command)}", "--tool-rounds", "2",
              "--summary-answer", "We ran the marker command twice.", "--context-length", "8192"]  # fmt: skip
    argv = ["tito_addon", "reference-backend", *script]
    with served(tmp_path, argv) as (_, port):
        status, models, _ = http(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == 8192
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8192}
        status, refused, _ = http(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        assert status == 400 and "maximum context length of 8192 tokens" in refused["message"], refused
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Run it."}]
        for round_ in range(3):
            status, reply, raw = http(
                f"http://127.0.0.1:{port}/v1/chat/completions", {"model": "m", "messages": messages, "tools": tools}
            )
            assert status == 200, raw[:500]
            message = reply["choices"][0]["message"]
            if round_ < 2:
                calls = message["tool_calls"]
                assert calls and {c["function"]["name"] for c in calls} == {"Bash"}, message
                assert all(json.loads(c["function"]["arguments"]) == command for c in calls)
                assert reply["choices"][0]["finish_reason"] == "tool_calls"
                messages.append({"role": "assistant", "content": message["content"], "tool_calls": calls})
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "tito-ok"} for c in calls]
                messages.append({"role": "system", "content": "context an agent adds after the results"})
            else:
                assert not message.get("tool_calls") and message["content"], message
                assert reply["choices"][0]["finish_reason"] == "stop"
                messages.append({"role": "assistant", "content": message["content"]})
        # A compaction (Claude Code's and Codex's instructions): a text answer holding the summary, though the
        # prompt has had no tool round yet and tools are offered.
        for instruction in (
            "Respond with TEXT ONLY: an <analysis> block followed by a <summary> block.",
            "You are performing a CONTEXT CHECKPOINT COMPACTION. Summarize the conversation.",
        ):
            body = {"model": "m", "messages": [*messages, {"role": "user", "content": instruction}], "tools": tools}
            status, reply, raw = http(f"http://127.0.0.1:{port}/v1/chat/completions", body)
            assert status == 200, raw[:500]
            message = reply["choices"][0]["message"]
            assert not message.get("tool_calls") and reply["choices"][0]["finish_reason"] == "stop", message
            assert "<summary>\nWe ran the marker command twice.\n</summary>" in message["content"]


@pytest.mark.parametrize(
    "flags, error",
    [
        (["--call-tool", "Bash"], "expected NAME=JSON"),
        (["--call-tool", "Bash=[1]"], "expected NAME=JSON"),
        (["--call-tool", "Bash={nope"], "the arguments are not JSON"),
        (["--tool-rounds", "-1"], "--tool-rounds must be 0 or more"),
        (["--context-length", "1"], "--context-length must be 2 or more"),
    ],
)
def test_cli_refuses_bad_script_flags(flags: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--tokenizer", str(TOKENIZER_DIR), *flags])
    assert exited.value.code == 2 and error in capsys.readouterr().err


def test_main_rejects_missing_tokenizer_arg() -> None:
    with pytest.raises(SystemExit):
        main([])
