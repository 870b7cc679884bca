"""The replicas' routed experts (rollout routing replay), over loopback HTTP and the real Qwen3 tokenizer: where each
server puts them, their encoding decoded as a client would, and the exact rows `[start, seqlen - 1)` of
`expert_routes` over the prompt and the output ids the answer reports.

sglang 0.5.23: `choices[0].meta_info.routed_experts` with `return_meta_info`, else response-level `sglext`; streamed,
in the sglext chunk after the finish chunk (framed: a plain chunk of its own before the `sglext_ids` event); raw int32.
vLLM 0.32: `choices[0].routed_experts`, a `.npy` (uint8 for 8 experts), streamed on the finishing chunk only.
"""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import requests
from pydantic import ValidationError
from support.basics import tokenizer_path, wait_until
from transformers import AutoTokenizer

from tito_addon.replicas.expert_routing import expert_routes
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

LAYERS, TOPK, EXPERTS = 4, 2, 8
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tok = AutoTokenizer.from_pretrained(tokenizer_path("qwen3"))
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


@pytest.fixture(scope="module")
def _sglang() -> Iterator[ReplicaThread]:
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), routed_experts=True)) as replica:
        yield replica


def cleared(replica, **defaults):
    """The replica with nothing received, then its config's `defaults` put back (a test may change them)."""
    replica.clear()
    yield replica
    for name, value in defaults.items():
        setattr(replica.backend.config, name, value)


@pytest.fixture
def sglang(_sglang: ReplicaThread) -> Iterator[ReplicaThread]:
    yield from cleared(_sglang, routed_experts=True, token_delay_s=0.0)


@pytest.fixture(scope="module")
def _vllm() -> Iterator[VllmReplicaThread]:
    with VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), routed_experts=True)) as replica:
        yield replica


@pytest.fixture
def vllm(_vllm: VllmReplicaThread) -> Iterator[VllmReplicaThread]:
    yield from cleared(_vllm, routed_experts=True, token_delay_s=0.0, version="0.32.0", moe_experts=EXPERTS)


def expected(ids: list[int], start: int) -> np.ndarray:
    return expert_routes(ids, start, len(ids) - 1, LAYERS, TOPK, EXPERTS)


def sglang_rows(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), np.int32).reshape(-1, LAYERS, TOPK)


def vllm_rows(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)))


def sse(text: str) -> list[tuple[str | None, Any]]:
    """`(event name, parsed data)` of each SSE event, `[DONE]` left as the string."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = lines["data"]
        events.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    return events


# ------------------------------------------------------------------------------------------------ sglang


def chat(replica: ReplicaThread, prompt: list[int], headers: dict[str, str] | None = None, **fields: Any):
    body = {"model": "reference-model", "messages": MESSAGES, "input_ids": prompt, **fields}
    return requests.post(replica.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("start", [0, 5])
def test_sglang_whole_answer_has_the_routes_in_meta_info_with_return_meta_info(sglang, prompt, start) -> None:
    out = chat(
        sglang,
        prompt,
        return_routed_experts=True,
        routed_experts_start_len=start,
        return_meta_info=True,
        return_token_ids=True,
    ).json()
    choice = out["choices"][0]
    ids = choice["prompt_token_ids"] + choice["response_token_ids"]
    assert choice["response_token_ids"][-1] == choice["matched_stop"]  # the stop token is an output id with a row
    rows = sglang_rows(choice["meta_info"]["routed_experts"])
    assert rows.shape == (len(ids) - 1 - start, LAYERS, TOPK)
    assert np.array_equal(rows, expected(ids, start))
    assert "sglext" not in out  # 0.5.23 with return_meta_info: only in meta_info
    shifted = expert_routes(ids, start + 1, len(ids), LAYERS, TOPK, EXPERTS)
    assert not np.array_equal(rows, shifted)


def test_sglang_whole_answer_without_meta_info_has_them_in_sglext_beside_the_ids(sglang, prompt) -> None:
    out = chat(
        sglang, prompt, return_routed_experts=True, routed_experts_start_len=3, return_output_ids_in_sglext=True
    ).json()
    assert list(out["sglext"]) == ["routed_experts", "output_ids"]
    ids = prompt + out["sglext"]["output_ids"][0]
    assert np.array_equal(sglang_rows(out["sglext"]["routed_experts"]), expected(ids, 3))
    assert "meta_info" not in out["choices"][0]


@pytest.mark.parametrize("framed", [False, True], ids=["plain", "framed"])
def test_sglang_stream_sends_the_routes_once_in_the_sglext_chunk(sglang, prompt, framed) -> None:
    headers = {"x-sglext-ids-framed": "1"} if framed else None
    response = chat(
        sglang,
        prompt,
        headers,
        stream=True,
        return_routed_experts=True,
        routed_experts_start_len=4,
        return_output_ids_in_sglext=True,
        stream_options={"include_usage": True},
    )
    events = sse(response.text)
    assert events[-1] == (None, "[DONE]") and "usage" in events[-2][1]
    finish = max(i for i, (_, e) in enumerate(events[:-1]) if e["choices"] and e["choices"][0]["finish_reason"])
    tail = events[finish + 1 : -2]  # between the finish chunk and the usage chunk
    with_routes = [e for _, e in events[:-1] if "routed_experts" in e.get("sglext", {})]
    assert len(with_routes) == 1 and with_routes[0]["choices"] == []
    if framed:  # a plain data chunk of its own, then the ids' named event
        assert [(name, list(e["sglext"])) for name, e in tail] == [
            (None, ["routed_experts"]),
            ("sglext_ids", ["output_ids"]),
        ]
    else:  # one chunk: the routes and the ids together
        assert [(name, list(e["sglext"])) for name, e in tail] == [(None, ["routed_experts", "output_ids"])]
    ids = prompt + tail[-1][1]["sglext"]["output_ids"][0]
    assert np.array_equal(sglang_rows(with_routes[0]["sglext"]["routed_experts"]), expected(ids, 4))


@pytest.mark.parametrize("start", [-1, 13])
def test_sglang_refuses_a_start_outside_the_prompt_as_its_scheduler_aborts(sglang, prompt, start) -> None:
    assert len(prompt) == 12
    if start < 0:
        message = (
            "recv_req.routed_experts_start_len=-1 is lower than 0. Please use a non-negative routed_experts_start_len."
        )
    else:
        message = (
            "recv_req.routed_experts_start_len=13 is higher than the number of input tokens "
            "len(req.origin_input_ids)=12. Please use a smaller routed_experts_start_len."
        )
    sglang.backend.config.routed_experts = False  # the check is the scheduler's, whatever the server flag
    whole = chat(sglang, prompt, return_routed_experts=True, routed_experts_start_len=start, return_meta_info=True)
    assert whole.status_code == 400
    assert whole.json() == {
        "object": "error",
        "message": message,
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    streamed = chat(sglang, prompt, stream=True, return_routed_experts=True, routed_experts_start_len=start)
    assert streamed.status_code == 200
    error = {"object": "error", "message": message, "type": "BAD_REQUEST", "param": None, "code": 400}
    assert sse(streamed.text) == [(None, {"error": error}), (None, "[DONE]")]
    native = requests.post(
        sglang.url + "/generate",
        json={"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": start},
        timeout=30,
    )
    assert (native.status_code, native.json()) == (400, {"error": {"message": message}})
    assert chat(sglang, prompt, routed_experts_start_len=start).status_code == 200  # not asked for routes: no check


def test_sglang_without_the_server_flag_silently_leaves_the_routes_out(sglang, prompt) -> None:
    sglang.backend.config.routed_experts = False
    whole = chat(sglang, prompt, return_routed_experts=True, return_meta_info=True).json()
    assert "routed_experts" not in whole["choices"][0]["meta_info"] and "sglext" not in whole
    assert "sglext" not in chat(sglang, prompt, return_routed_experts=True).json()
    streamed = chat(sglang, prompt, stream=True, return_routed_experts=True)
    assert "sglext" not in streamed.text


def test_sglang_not_asked_has_no_routes(sglang, prompt) -> None:
    whole = chat(sglang, prompt, return_meta_info=True).json()
    assert "routed_experts" not in whole["choices"][0]["meta_info"] and "sglext" not in whole


def test_sglang_native_generate_routes_the_prompt(sglang, prompt) -> None:
    body = {"input_ids": prompt, "return_routed_experts": True, "routed_experts_start_len": 2, "max_new_tokens": 0}
    meta = requests.post(sglang.url + "/generate", json=body, timeout=30).json()["meta_info"]
    assert np.array_equal(sglang_rows(meta["routed_experts"]), expected(prompt, 2))


def abort_after(url: str, replica, tokens: int, body: dict[str, Any]) -> None:
    """Once the generation in flight sampled `tokens`, abort every request (sglang's `/abort_request`)."""
    pause = replica.backend.pause
    assert wait_until(lambda: any(len(g.labels) >= tokens for g in list(pause.in_flight.values())), timeout=10)
    assert requests.post(url, json=body, timeout=10).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sglang_aborted_generation_routes_what_it_computed(sglang, prompt, stream) -> None:
    sglang.backend.config.token_delay_s = 0.02
    cutter = threading.Thread(target=abort_after, args=(sglang.url + "/abort_request", sglang, 3, {"abort_all": True}))
    cutter.start()
    fields: dict[str, Any] = {"return_routed_experts": True, "routed_experts_start_len": 12}
    if stream:
        events = sse(chat(sglang, prompt, stream=True, return_output_ids_in_sglext=True, **fields).text)
        (ext,) = [e["sglext"] for _, e in events[:-1] if "sglext" in e]
        output, routes = ext["output_ids"][0], ext["routed_experts"]
        assert any(e["choices"] and e["choices"][0]["finish_reason"] == "abort" for _, e in events[:-1])
    else:
        out = chat(sglang, prompt, return_meta_info=True, return_token_ids=True, **fields).json()
        assert out["choices"][0]["finish_reason"] == "abort"
        output, routes = out["choices"][0]["response_token_ids"], out["choices"][0]["meta_info"]["routed_experts"]
    cutter.join()
    assert 3 <= len(output) < 60
    rows = sglang_rows(routes)
    assert rows.shape == (len(output) - 1, LAYERS, TOPK)  # [prompt, prompt + k - 1)
    assert np.array_equal(rows, expected(prompt + output, 12))


# ------------------------------------------------------------------------------------------------ vLLM


def generate(replica: VllmReplicaThread, prompt: list[int], **sampling: Any) -> requests.Response:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 200, **sampling}}
    return requests.post(replica.url + "/inference/v1/generate", json=body, timeout=30)


@pytest.mark.parametrize("version", ["0.32.0", "0.24.0"])
@pytest.mark.parametrize("start", [0, 7])
def test_vllm_whole_generate_has_the_routes_as_npy(vllm, prompt, version, start) -> None:
    vllm.backend.config.version = version
    choice = generate(vllm, prompt, routed_experts_prompt_start=start).json()["choices"][0]
    rows = vllm_rows(choice["routed_experts"])
    ids = prompt + choice["token_ids"]
    assert rows.dtype == np.uint8 and rows.shape == (len(ids) - 1 - start, LAYERS, TOPK)
    assert np.array_equal(rows, expected(ids, start))


def test_vllm_routes_follow_a_stop_string_trim_and_widen_for_many_experts(vllm, prompt) -> None:
    choice = generate(vllm, prompt, stop=["</think>"]).json()["choices"][0]
    assert choice["stop_reason"] == "</think>" and len(choice["token_ids"]) < 40
    ids = prompt + choice["token_ids"]
    assert np.array_equal(vllm_rows(choice["routed_experts"]), expected(ids, 0))
    vllm.backend.config.moe_experts = 300
    rows = vllm_rows(generate(vllm, prompt, stop=["</think>"]).json()["choices"][0]["routed_experts"])
    assert rows.dtype == np.uint16 and np.array_equal(rows, expert_routes(ids, 0, len(ids) - 1, LAYERS, TOPK, 300))


def test_vllm_stream_carries_the_routes_on_the_finishing_chunk_only(vllm, prompt) -> None:
    text = generate(vllm, prompt, routed_experts_prompt_start=12).text
    body = {
        "token_ids": prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "sampling_params": {"max_tokens": 200, "routed_experts_prompt_start": 12},
    }
    events = [e for _, e in sse(requests.post(vllm.url + "/inference/v1/generate", json=body, timeout=30).text)[:-1]]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert all(c["routed_experts"] is None for c in choices[:-1]) and choices[-1]["finish_reason"] == "stop"
    ids = prompt + [t for c in choices for t in c["token_ids"]]
    assert np.array_equal(vllm_rows(choices[-1]["routed_experts"]), expected(ids, 12))
    assert vllm_rows(json.loads(text)["choices"][0]["routed_experts"]).shape == (len(ids) - 13, LAYERS, TOPK)


@pytest.mark.parametrize("start", [-1, 13])
def test_vllm_refuses_a_start_outside_the_prompt(vllm, prompt, start) -> None:
    vllm.backend.config.routed_experts = False  # the input processor checks it whatever the flag
    response = generate(vllm, prompt, routed_experts_prompt_start=start)
    message = (
        f"routed_experts_prompt_start must be between 0 and the prompt length (12), inclusive. "
        f"(parameter=routed_experts_prompt_start, value={start})"
    )
    error = {"message": message, "type": "BadRequestError", "param": "routed_experts_prompt_start", "code": 400}
    assert (response.status_code, response.json()) == (400, {"error": error})


def test_vllm_without_the_server_flag_answers_null(vllm, prompt) -> None:
    vllm.backend.config.routed_experts = False
    assert generate(vllm, prompt).json()["choices"][0]["routed_experts"] is None
    body = {"token_ids": prompt, "stream": True, "sampling_params": {"max_tokens": 200}}
    events = sse(requests.post(vllm.url + "/inference/v1/generate", json=body, timeout=30).text)[:-1]
    assert all(e["choices"][0]["routed_experts"] is None for _, e in events)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_vllm_aborted_generation_routes_its_partial_ids(vllm, prompt, stream) -> None:
    vllm.backend.config.token_delay_s = 0.02
    cutter = threading.Thread(target=abort_after, args=(vllm.url + "/inference/v1/abort_requests", vllm, 3, {}))
    cutter.start()
    body = {
        "token_ids": prompt,
        "stream": stream,
        "sampling_params": {"max_tokens": 200, "routed_experts_prompt_start": 5},
    }
    response = requests.post(vllm.url + "/inference/v1/generate", json=body, timeout=30)
    cutter.join()
    if stream:
        choices = [e["choices"][0] for _, e in sse(response.text)[:-1]]
        assert all(c["routed_experts"] is None for c in choices[:-1])
        output, last = [t for c in choices for t in c["token_ids"]], choices[-1]
    else:
        last = response.json()["choices"][0]
        output = last["token_ids"]
    assert last["finish_reason"] == "abort" and 3 <= len(output) < 60
    assert np.array_equal(vllm_rows(last["routed_experts"]), expected(prompt + output, 5))


def test_vllm_derender_accepts_a_generate_response_with_routes(vllm, prompt) -> None:
    generated = generate(vllm, prompt).json()
    assert isinstance(generated["choices"][0]["routed_experts"], str)
    body = {"generate_response": generated, "chat_request": {"messages": MESSAGES}, "prompt_tokens": len(prompt)}
    url = vllm.url + "/v1/chat/completions/derender"
    derendered = requests.post(url, json=body, timeout=30)
    assert derendered.status_code == 200 and derendered.json()["choices"][0]["routed_experts"] is None
    generated["choices"][0]["routed_experts"] = [1, 2]
    refused = requests.post(url, json=body, timeout=30)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "body.generate_response.choices.0.routed_experts"


def test_the_moe_shape_is_validated() -> None:
    with pytest.raises(ValidationError, match="moe_topk"):
        VllmReplicaConfig(tokenizer="x", moe_topk=9, moe_experts=8)
    with pytest.raises(ValidationError):
        ReplicaConfig(tokenizer="x", moe_layers=0)
    assert expert_routes([5, 6], 0, 2, 1, 3, 3)[0, 0].tolist() == [2, 0, 1]  # distinct experts within a row
