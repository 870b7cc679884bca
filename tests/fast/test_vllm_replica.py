"""Tests for tito_addon.replicas.vllm_replica (the vLLM scale-out replica) over the real Qwen3 tokenizer.

The 0.32 mode is checked field by field against the bodies recorded from a live vLLM 0.32.0
(``shared/vllm_scale_out_examples``); 0.24 mode against wire-formats.md section 2.
"""

from __future__ import annotations

import http.client as http_client
import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from support.basics import REPO

from tito_addon.replicas.scripted_model import conversation_from_prompt
from tito_addon.replicas.vllm_derender import parse_hermes_tool_calls, parse_qwen3_reasoning
from tito_addon.replicas.vllm_replica import VllmReplica, VllmReplicaConfig, VllmReplicaThread

SHARED = REPO.parent / "shared"
TOKENIZER_DIR = SHARED / "tokenizers" / "qwen3"
EXAMPLES = SHARED / "vllm_scale_out_examples"
RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"
IM_END = 151645
THINK_START, THINK_END, TOOL_CALL_START = 151667, 151668, 151657
HEX16 = re.compile(r"[0-9a-f]{16}")
HEX32 = re.compile(r"[0-9a-f]{32}")

pytestmark = pytest.mark.skipif(
    not (TOKENIZER_DIR.is_dir() and EXAMPLES.is_dir()), reason=f"missing {TOKENIZER_DIR} or {EXAMPLES}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def example(name: str) -> Any:
    return json.loads((EXAMPLES / name).read_text())


def http(
    url: str, body: Any = None, *, method: str | None = None, timeout: float = 10.0, raw: bool = False
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    return status, (text if raw else json.loads(text))


def same_shape(ours: Any, real: Any, where: str = "$") -> None:
    """Same keys (and key order) at every dict, same JSON types, null exactly where real is null."""
    if isinstance(real, dict):
        assert isinstance(ours, dict), f"{where}: {type(ours).__name__} instead of an object"
        assert list(ours) == list(real), f"{where}: keys {list(ours)} != real {list(real)}"
        for k in real:
            same_shape(ours[k], real[k], f"{where}.{k}")
    elif isinstance(real, list):
        assert isinstance(ours, list), f"{where}: {type(ours).__name__} instead of a list"
        if real and ours:
            same_shape(ours[0], real[0], f"{where}[0]")
    elif real is None:
        assert ours is None, f"{where}: {ours!r} where the real server sends null"
    else:
        assert type(ours) is type(real), f"{where}: {type(ours).__name__} != {type(real).__name__}"


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------ fixtures


def _thread(**kw: Any) -> VllmReplicaThread:
    return VllmReplicaThread(VllmReplicaConfig(tokenizer=str(TOKENIZER_DIR), **kw))


@pytest.fixture(scope="module")
def _v32() -> Iterator[VllmReplicaThread]:
    # the recording server: --max-model-len 2048 --enable-scale-out + hermes + qwen3 parsers
    with _thread(max_model_len=2048) as r:
        yield r


@pytest.fixture()
def v32(_v32: VllmReplicaThread) -> VllmReplicaThread:
    _v32.clear()
    return _v32


@pytest.fixture(scope="module")
def _v32_plain() -> Iterator[VllmReplicaThread]:
    # the recording server of chat_req/render_resp/generate_resp: no tool or reasoning parser
    with _thread(max_model_len=2048, tool_parser=False, reasoning_parser=False) as r:
        yield r


@pytest.fixture()
def v32_plain(_v32_plain: VllmReplicaThread) -> VllmReplicaThread:
    _v32_plain.clear()
    return _v32_plain


@pytest.fixture(scope="module")
def _v24() -> Iterator[VllmReplicaThread]:
    with _thread(version="0.24.0", enable_scale_out=False) as r:  # 0.24 has no gating: the flag is moot
        yield r


@pytest.fixture()
def v24(_v24: VllmReplicaThread) -> VllmReplicaThread:
    _v24.clear()
    return _v24


def chain(r: VllmReplicaThread, chat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """render -> generate -> derender; returns the three response bodies."""
    st, rendered = http(r.url + RENDER, chat)
    assert st == 200, rendered
    st, gen = http(r.url + GENERATE, rendered)
    assert st == 200, gen
    der_req = {"generate_response": gen, "prompt_tokens": len(rendered["token_ids"]), "chat_request": chat}
    if r.config.version == "0.32.0":
        der_req["prompt_token_ids"] = rendered["token_ids"]
    else:
        der_req["model"] = chat["model"]
    st, der = http(r.url + DERENDER, der_req)
    assert st == 200, der
    return rendered, gen, der


# ------------------------------------------------------------------------------ 0.32 vs the real bodies


def test_render_e2e_matches_the_real_body(v32: VllmReplicaThread) -> None:
    real = example("e2e_render_resp.json")
    st, ours = http(v32.url + RENDER, example("e2e_chat_req.json"))
    assert st == 200
    same_shape(ours, real)
    assert ours["token_ids"] == real["token_ids"]  # the real render == HF apply_chat_template
    assert ours["sampling_params"] == real["sampling_params"]  # deterministic: equal, not just same keys
    assert {k: v for k, v in ours.items() if k != "request_id"} == {k: v for k, v in real.items() if k != "request_id"}
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", ours["request_id"])


def test_generate_and_derender_e2e_match_the_real_bodies(v32: VllmReplicaThread) -> None:
    chat = example("e2e_chat_req.json")
    rendered, gen, der = chain(v32, chat)
    real_gen = example("e2e_generate_resp.json")
    same_shape(gen, real_gen)
    assert gen["request_id"] == "generate-tokens-" + rendered["request_id"]
    choice = gen["choices"][0]
    assert len(choice["token_ids"]) == 12 and choice["finish_reason"] == "length"  # max_tokens 12, like the real run
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]
    assert gen["usage"]["prompt_tokens"] == len(rendered["token_ids"]) == real_gen["usage"]["prompt_tokens"]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"]

    # the derender request is built exactly like the recorded one
    real_req = example("e2e_derender_req.json")
    assert set(real_req) == {"generate_response", "prompt_tokens", "prompt_token_ids", "chat_request"}
    real_der = example("e2e_derender_resp.json")
    same_shape(der, real_der)
    assert der["id"] == gen["request_id"]
    assert der["usage"] == {**real_der["usage"]}  # 155 + 12, same as the real one
    msg = der["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"] is None  # truncated inside <think>: all reasoning
    assert msg["reasoning"].startswith("\nThe user wants")
    lp = der["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in lp] == [v32.backend.tokenizer.token_texts([t])[0] for t in choice["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in lp)


def test_synthetic_derender_matches_the_real_body(v32: VllmReplicaThread) -> None:
    st, ours = http(v32.url + DERENDER, example("synthetic_derender_req.json"))
    assert st == 200
    real = example("synthetic_derender_resp.json")
    same_shape(ours, real)
    call = ours["choices"][0]["message"]["tool_calls"][0]
    assert HEX16.fullmatch(call["id"]) and call["id"] != real["choices"][0]["message"]["tool_calls"][0]["id"]
    call["id"] = real["choices"][0]["message"]["tool_calls"][0]["id"]
    ours["created"] = real["created"]
    assert ours == real  # reasoning unstripped, content null, finish_reason "stop" verbatim despite the call


def test_render_drops_max_tokens_16_like_the_real_server(v32_plain: VllmReplicaThread) -> None:
    real = example("render_resp2.json")
    st, ours = http(v32_plain.url + RENDER, example("chat_req2.json"))
    assert st == 200
    same_shape(ours, real)
    assert ours["sampling_params"] == real["sampling_params"] and "max_tokens" not in ours["sampling_params"]
    assert ours["token_ids"] == real["token_ids"]
    base = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Say hi."}]}
    for key, n, kept in (
        ("max_completion_tokens", 16, False),
        ("max_tokens", 15, True),
        ("max_tokens", 17, True),
    ):
        st, body = http(v32_plain.url + RENDER, {**base, key: n})
        assert ("max_tokens" in body["sampling_params"]) is kept, (key, n)
    # ... and generate then runs as long as it likes (the real one ran to max_model_len)
    st, gen = http(v32_plain.url + GENERATE, ours)
    assert st == 200 and len(gen["choices"][0]["token_ids"]) > 16


def test_plain_server_render_and_generate_match_the_real_bodies(v32_plain: VllmReplicaThread) -> None:
    real = example("render_resp.json")
    st, ours = http(v32_plain.url + RENDER, example("chat_req.json"))
    assert st == 200
    same_shape(ours, real)
    assert {k: v for k, v in ours.items() if k != "request_id"} == {k: v for k, v in real.items() if k != "request_id"}
    assert "top_p" not in ours["sampling_params"]  # greedy (temperature 0): top_p/min_p omitted
    st, gen = http(v32_plain.url + GENERATE, ours)
    same_shape(gen, example("generate_resp.json"))
    assert len(gen["choices"][0]["token_ids"]) == 8


def test_multi_turn_render_matches_the_real_bodies(v32: VllmReplicaThread) -> None:
    real = example("turn2_render_resp.json")
    st, ours = http(v32.url + RENDER, example("turn2_render_req.json"))
    assert st == 200
    same_shape(ours, real)
    assert {k: v for k, v in ours.items() if k != "request_id"} == {k: v for k, v in real.items() if k != "request_id"}
    assert ours["reasoning_ended"] is False  # the earlier turn's </think> does not count
    drop = example("multiturn_think_drop_vllm.json")
    st, ours = http(v32.url + RENDER, {"model": "tiny-qwen3", "messages": drop["turn2_messages"]})
    assert ours["token_ids"] == drop["turn2_prompt_ids_from_vllm_render"]


def test_version_health_models(v32: VllmReplicaThread, v24: VllmReplicaThread) -> None:
    assert http(v32.url + "/version", method="GET") == (200, {"version": "0.32.0"})
    assert http(v24.url + "/version", method="GET") == (200, {"version": "0.24.0"})
    assert http(v32.url + "/health", method="GET", raw=True) == (200, "")
    st, models = http(v32.url + "/v1/models", method="GET")
    assert st == 200 and models["data"][0]["id"] == "tiny-qwen3" and models["data"][0]["max_model_len"] == 2048


# ------------------------------------------------------------------------------ behaviour (0.32)


def test_generate_uses_exactly_the_given_token_ids(v32: VllmReplicaThread) -> None:
    tok = v32.backend.tokenizer
    st, rendered = http(
        v32.url + RENDER, {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Weather?"}]}
    )
    ids = list(rendered["token_ids"])
    # replace the canonical "Weather" piece by a non-canonical split: same text, different ids
    i = next(k for k, t in enumerate(ids) if tok.split_of(t) is not None and k > 2)
    ids[i : i + 1] = list(tok.split_of(ids[i]))
    assert tok.encode(tok.decode(ids)) != ids
    st, gen = http(v32.url + GENERATE, {**rendered, "token_ids": ids, "return_token_ids": True})
    assert st == 200
    assert gen["prompt_token_ids"] == ids and gen["usage"]["prompt_tokens"] == len(ids)
    assert v32.generated()[-1]["prompt_ids"] == ids
    assert v32.received()[-1] == (GENERATE, {**rendered, "token_ids": ids, "return_token_ids": True})


def test_completion_has_noncanonical_splits_and_ends_with_im_end() -> None:
    chat = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Tell me about Lisbon."}]}
    seen = {}
    for noncanonical in (True, False):
        with _thread(noncanonical=noncanonical) as r:
            _, gen, der = chain(r, chat)
            ids = gen["choices"][0]["token_ids"]
            tok = r.backend.tokenizer
            seen[noncanonical] = ids
            assert ids[-1] == IM_END and gen["choices"][0]["finish_reason"] == "stop"
            assert (tok.encode(tok.decode(ids[:-1])) != ids[:-1]) is noncanonical
            assert r.generated()[-1]["completion_ids"] == ids
    assert seen[True] != seen[False]


def test_tool_call_turn_then_tool_result_turn(v32: VllmReplicaThread) -> None:
    chat = {
        "model": "tiny-qwen3",
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER_TOOL],
    }
    rendered, gen, der = chain(v32, chat)
    ids = gen["choices"][0]["token_ids"]
    assert ids[0] == THINK_START and THINK_END in ids and TOOL_CALL_START in ids and ids[-1] == IM_END
    assert gen["choices"][0]["finish_reason"] == "stop"
    choice = der["choices"][0]
    assert choice["finish_reason"] == "stop"  # passed through verbatim even though calls were parsed
    msg = choice["message"]
    assert msg["content"] is None and msg["reasoning"].startswith("\n") and msg["reasoning"].endswith("\n")
    [call] = msg["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'} and HEX16.fullmatch(call["id"])

    turn2 = {
        **chat,
        "messages": chat["messages"]
        + [
            {"role": "assistant", "content": "", "reasoning": msg["reasoning"], "tool_calls": msg["tool_calls"]},
            {"role": "tool", "tool_call_id": call["id"], "content": '{"temp_c": 21}'},
        ],
    }
    _, gen2, der2 = chain(v32, turn2)
    msg2 = der2["choices"][0]["message"]
    assert "tool_calls" not in msg2 and msg2["reasoning"].startswith("\nThe tool returned")
    # vLLM's parser path decodes with special tokens kept: content keeps the leading "\n\n" and the <|im_end|>
    assert msg2["content"].startswith("\n\nTurn 2:") and msg2["content"].endswith("<|im_end|>")


def test_enable_thinking_false(v32: VllmReplicaThread) -> None:
    chat = {
        "model": "tiny-qwen3",
        "messages": [{"role": "user", "content": "Hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    rendered, gen, der = chain(v32, chat)
    assert rendered["reasoning_ended"] is True
    assert rendered["reasoning_parser_kwargs"]["chat_template_kwargs"]["enable_thinking"] is False
    assert THINK_START not in gen["choices"][0]["token_ids"]
    msg = der["choices"][0]["message"]
    assert msg["reasoning"] is None and msg["content"].startswith("Turn 1:")


def test_max_tokens_and_default_max_tokens() -> None:
    with _thread(max_model_len=160) as r:
        st, rendered = http(r.url + RENDER, {**example("e2e_chat_req.json"), "max_tokens": None})
        assert rendered["sampling_params"]["max_tokens"] == 160 - 155  # max_model_len - prompt
        sp = {k: v for k, v in rendered["sampling_params"].items() if k != "max_tokens"}
        st, gen = http(r.url + GENERATE, {**rendered, "sampling_params": sp})  # absent: rest of the context
        assert len(gen["choices"][0]["token_ids"]) == 5 and gen["choices"][0]["finish_reason"] == "length"
        st, gen = http(r.url + GENERATE, {**rendered, "sampling_params": {**sp, "max_tokens": 3}})
        assert len(gen["choices"][0]["token_ids"]) == 3
        st, err = http(r.url + GENERATE, {**rendered, "token_ids": rendered["token_ids"] * 2})
        assert st == 400 and err["error"]["type"] == "BadRequestError"


def test_top_logprobs_null_means_no_logprobs(v32: VllmReplicaThread) -> None:
    chat = {**example("e2e_chat_req.json"), "top_logprobs": None}
    rendered, gen, der = chain(v32, chat)
    assert "logprobs" not in rendered["sampling_params"]
    assert gen["choices"][0]["logprobs"] is None and der["choices"][0]["logprobs"] is None
    rendered, gen, _ = chain(v32, {**chat, "top_logprobs": 0})
    assert rendered["sampling_params"]["logprobs"] == 0
    assert all(e["top_logprobs"] == [] for e in gen["choices"][0]["logprobs"]["content"])


def test_streaming_generate(v32: VllmReplicaThread) -> None:
    st, rendered = http(v32.url + RENDER, {**example("e2e_chat_req.json"), "max_tokens": 40})
    st, full = http(v32.url + GENERATE, rendered)
    streamed = {**rendered, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    st, text = http(v32.url + GENERATE, streamed, raw=True)
    assert st == 200
    events = sse_events(text)
    *tokens, usage = events
    assert [e["choices"][0]["token_ids"] for e in tokens] == [[t] for t in full["choices"][0]["token_ids"]]
    assert tokens[0]["prompt_token_ids"] == rendered["token_ids"] and tokens[1]["prompt_token_ids"] is None
    assert all(e["usage"] is None and e["output_mode"] == "tokens" for e in tokens)
    assert [e["choices"][0]["finish_reason"] for e in tokens][-2:] == [None, "length"]
    assert tokens[-1]["choices"][0]["weight_versions"] == [{"version": "default", "start": 0, "end": 40}]
    assert tokens[0]["choices"][0]["logprobs"]["content"][0]["token_id"] == tokens[0]["choices"][0]["token_ids"][0]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 40


def test_errors(v32: VllmReplicaThread, v32_plain: VllmReplicaThread) -> None:
    chat = example("e2e_chat_req.json")
    st, err = http(v32.url + RENDER, {**chat, "model": "other"})
    assert st == 404 and err == {
        "error": {
            "message": "The model `other` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    st, err = http(v32_plain.url + RENDER, chat)  # tools need --enable-auto-tool-choice
    assert st == 400 and "--enable-auto-tool-choice" in err["error"]["message"]
    st, rendered = http(v32.url + RENDER, chat)
    for bad in ([], [-1], [10**9], ["1"]):
        st, err = http(v32.url + GENERATE, {**rendered, "token_ids": bad})
        assert st == 400 and set(err["error"]) == {"message", "type", "param", "code"}, bad
    st, gen = http(v32.url + GENERATE, rendered)
    st, err = http(v32.url + DERENDER, {"generate_response": gen, "prompt_tokens": 1})  # parsers need chat_request
    assert st == 400 and "chat_request" in err["error"]["message"]
    st, err = http(v32.url + DERENDER, {"generate_response": {**gen, "output_mode": "text"}, "chat_request": chat})
    assert st == 400
    empty = {**gen, "choices": [{**gen["choices"][0], "token_ids": []}]}
    st, err = http(v32.url + DERENDER, {"generate_response": empty, "chat_request": chat})
    assert st == 400 and "empty or null token_ids" in err["error"]["message"]
    # without parsers the chat_request may be omitted: plain detokenization
    st, der = http(v32_plain.url + DERENDER, {"generate_response": gen})
    assert st == 200 and der["choices"][0]["message"]["content"] == v32.backend.tokenizer.tok.decode(
        gen["choices"][0]["token_ids"], skip_special_tokens=True
    )


def test_scale_out_disabled_answers_403() -> None:
    with _thread(enable_scale_out=False) as r:
        for path in (RENDER, GENERATE, DERENDER):
            st, err = http(r.url + path, {"model": "tiny-qwen3"})
            assert st == 403 and err["error"]["type"] == "PermissionDeniedError" and err["error"]["code"] == 403
        assert [p for p, _ in r.received()] == [RENDER, GENERATE, DERENDER]
        assert http(r.url + "/version", method="GET")[0] == 200


# ------------------------------------------------------------------------------ 0.24 mode


def test_v24_shapes(v24: VllmReplicaThread) -> None:
    chat = {**example("e2e_chat_req.json"), "max_tokens": 60, "top_logprobs": 2}
    rendered, gen, der = chain(v24, chat)  # enable_scale_out=False is moot before 0.30
    assert list(rendered) == [
        "request_id",
        "token_ids",
        "features",
        "sampling_params",
        "model",
        "stream",
        "stream_options",
        "cache_salt",
        "priority",
        "kv_transfer_params",
    ]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", rendered["request_id"])
    assert list(gen) == ["request_id", "choices", "prompt_logprobs", "kv_transfer_params"]  # no usage, no model
    assert HEX32.fullmatch(gen["request_id"]) and rendered["request_id"] not in gen["request_id"]
    choice = gen["choices"][0]
    assert list(choice) == ["index", "logprobs", "finish_reason", "token_ids", "routed_experts"]
    entry = choice["logprobs"]["content"][0]
    assert entry["token"] == f"token_id:{choice['token_ids'][0]}" and entry["bytes"] is None
    assert [t["token"] for t in entry["top_logprobs"]][0] == entry["token"] and len(entry["top_logprobs"]) == 2
    # stream is ignored in 0.24: a full JSON reply, and a fresh random request_id each time
    st, again = http(v24.url + GENERATE, {**rendered, "stream": True})
    assert st == 200 and again["choices"][0]["token_ids"] == choice["token_ids"]
    assert again["request_id"] != gen["request_id"]
    # derender: 0.24 field set, real token strings, random uuid tool-call ids, tool_calls always present
    assert der["id"] == gen["request_id"]
    assert not {"prompt_text", "metrics", "ec_transfer_params"} & set(der)
    assert der["choices"][0]["logprobs"]["content"][0]["token"] == "<think>"
    [call] = der["choices"][0]["message"]["tool_calls"]
    assert HEX32.fullmatch(call["id"]) and call["function"]["name"] == "get_weather"
    st, err = http(v24.url + DERENDER, {"generate_response": gen, "chat_request": chat})  # model required
    assert st == 400 and err["error"]["param"] == "model"
    st, der = http(
        v24.url + DERENDER, {"model": "tiny-qwen3", "generate_response": gen, "chat_request": {**chat, "tools": None}}
    )
    assert der["choices"][0]["message"]["tool_calls"] == []


# ------------------------------------------------------------------------------ faults


def test_status_faults_and_fifo_per_endpoint(v32: VllmReplicaThread) -> None:
    chat = example("e2e_chat_req.json")
    v32.set_faults(["generate:http500", "render:http400", "derender:http503", "render:none", "render:http429"])
    st, err = http(v32.url + RENDER, chat)  # the first *render* fault, although a generate fault is queued first
    assert st == 400 and err["error"] == {
        "message": "injected fault (render:http400)",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    st, rendered = http(v32.url + RENDER, chat)  # render:none
    assert st == 200
    assert http(v32.url + RENDER, chat)[0] == 429
    st, err = http(v32.url + GENERATE, rendered)
    assert st == 500 and err["error"]["type"] == "InternalServerError"
    st, gen = http(v32.url + GENERATE, rendered)
    assert st == 200
    st, err = http(v32.url + DERENDER, {"generate_response": gen, "chat_request": chat})
    assert st == 503 and err["error"]["code"] == 503
    assert v32.backend.pending_faults() == []
    assert len(v32.generated()) == 1
    with pytest.raises(ValueError):
        v32.set_faults(["generate:not_chat"])


def test_generate_body_faults(v32: VllmReplicaThread) -> None:
    st, rendered = http(v32.url + RENDER, example("e2e_chat_req.json"))
    v32.set_faults(
        ["generate:missing_ids", "generate:empty_ids", "generate:non_int_ids", "generate:missing_logprobs"]
        + ["generate:logprobs_length", "generate:not_json"]
    )
    choices = [http(v32.url + GENERATE, rendered)[1]["choices"][0] for _ in range(5)]
    assert "token_ids" not in choices[0]
    assert choices[1]["token_ids"] == []
    assert choices[2]["token_ids"] and all(isinstance(t, str) for t in choices[2]["token_ids"])
    assert choices[3]["logprobs"] is None
    assert len(choices[4]["logprobs"]["content"]) == len(choices[4]["token_ids"]) - 1
    st, text = http(v32.url + GENERATE, rendered, raw=True)
    assert st == 200 and text == "{weird"
    # streaming gets the body faults too
    v32.set_faults(["generate:empty_ids"])
    st, text = http(v32.url + GENERATE, {**rendered, "stream": True}, raw=True)
    assert all(e["choices"][0]["token_ids"] == [] for e in sse_events(text))


def test_derender_body_faults(v32: VllmReplicaThread) -> None:
    chat = example("e2e_chat_req.json")
    req = example("synthetic_derender_req.json")
    v32.set_faults(["derender:not_chat", "derender:empty_message"])
    st, body = http(v32.url + DERENDER, req)
    assert st == 200 and body["object"] != "chat.completion" and "message" not in body["choices"][0]
    st, body = http(v32.url + DERENDER, req)
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning"] is None and "tool_calls" not in msg
    assert chat["model"] == body["model"]


def test_transport_faults(v32: VllmReplicaThread) -> None:
    st, rendered = http(v32.url + RENDER, example("e2e_chat_req.json"))
    v32.set_faults(["generate:reset", "derender:stall"])
    with pytest.raises((urllib.error.URLError, ConnectionError, http_client.HTTPException)):
        http(v32.url + GENERATE, rendered)
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        http(v32.url + DERENDER, example("synthetic_derender_req.json"), timeout=0.5)
    assert [p for p, _ in v32.received()] == [RENDER, GENERATE, DERENDER]
    assert http(v32.url + GENERATE, rendered)[0] == 200  # faults consumed


# ------------------------------------------------------------------------------ pure helpers


def test_parsers_like_vllm() -> None:
    assert parse_qwen3_reasoning("<think>\nA\n</think>\n\nB", True) == ("\nA\n", "\n\nB")
    assert parse_qwen3_reasoning("cut off", True) == ("cut off", None)
    assert parse_qwen3_reasoning("plain", False) == (None, "plain")
    calls, content = parse_hermes_tool_calls('\n\n<tool_call>\n{"name": "f", "arguments": {"x": "ü"}}\n</tool_call>')
    assert calls == [("f", '{"x": "ü"}')] and content is None
    calls, content = parse_hermes_tool_calls('Both.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert calls == [("f", "{}")] and content == "Both.\n"
    assert parse_hermes_tool_calls('<tool_call>\n{"name": "f", "argu') == ([], '<tool_call>\n{"name": "f", "argu')


def test_conversation_from_prompt(v32: VllmReplicaThread) -> None:
    st, rendered = http(v32.url + RENDER, example("turn2_render_req.json"))
    conv, thinking = conversation_from_prompt(v32.backend.tokenizer.decode(rendered["token_ids"]))
    assert thinking is True
    assert [m["role"] for m in conv["messages"]] == ["system", "user", "assistant", "tool"]
    assert conv["messages"][-1]["content"] == '{"temp_c": 21}'
    assert conv["tools"] == [example("turn2_render_req.json")["tools"][0]]
    assert isinstance(v32.backend, VllmReplica)
