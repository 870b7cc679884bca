"""Live streaming through mitmdump on a backend that streams exact ids (vLLM >= 0.31: streaming generate plus
streaming derender): token-by-token chunks, the same recorded ids as a whole turn, errors, and an agent that
hangs up mid-stream (the upstream generation is cancelled and nothing is recorded)."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from pathlib import Path

import openai
import pytest
from support.basics import TOOLS, tokenizer_path
from support.proxy_harness import Mitmdump, post, vllm_proxy

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), stream_delay_s=0.02)
    record_dir = tmp_path_factory.mktemp("rec")
    with (
        VllmReplicaThread(config) as replica,
        vllm_proxy(replica.url, record_dir, record_dir.parent) as proxy,
    ):
        yield replica, proxy, record_dir


def client(proxy: Mitmdump, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": session})


def records(record_dir: Path, session: str):
    path = record_dir / session_file_name(session)
    if not path.exists():
        return [], {}
    recorded = read_session_file(path)
    return recorded.turns, recorded.full_ids()


@pytest.mark.parametrize("first", ["Weather in Paris?", "Tell me about Oslo."])
def test_a_live_turn_records_exactly_what_a_whole_turn_records(stack, first: str) -> None:
    replica, proxy, record_dir = stack
    replica.backend.reset()
    whole, live = f"whole-{uuid.uuid4().hex[:6]}", f"live-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "user", "content": first}]
    plain = client(proxy, whole).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=3)
    with client(proxy, live).chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, seed=3) as events:
        kinds = [event.type for event in events]
        streamed = events.get_final_completion()
    assert kinds.count("chunk") > 5, "a live turn arrives in many chunks"
    whole_turns, whole_ids = records(record_dir, whole)
    live_turns, live_ids = records(record_dir, live)
    assert live_ids == whole_ids and live_turns[0].completion_logprobs == whole_turns[0].completion_logprobs
    a, b = plain.choices[0], streamed.choices[0]
    assert a.finish_reason == b.finish_reason
    assert a.message.content == b.message.content
    assert (a.message.model_extra or {}).get("reasoning") == (b.message.model_extra or {}).get("reasoning")
    assert [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in b.message.tool_calls or []
    ]
    stored_whole = {k: v for k, v in whole_turns[0].assistant_message.items() if k != "tool_calls"}
    stored_live = {k: v for k, v in live_turns[0].assistant_message.items() if k != "tool_calls"}
    assert stored_whole == stored_live
    generate_bodies = [body for path, body in replica.received() if path == "/inference/v1/generate"]
    assert [body.get("stream") for body in generate_bodies] == [False, True]


def test_live_wire_format_with_usage(stack) -> None:
    replica, proxy, _ = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to three."}], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    response = post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["x-tito-stream"] == "live"
    assert response.headers["content-type"].startswith("text/event-stream")
    data = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_errors_before_the_first_chunk_keep_their_status(stack) -> None:
    replica, proxy, record_dir = stack
    replica.backend.reset()
    replica.set_faults(["render:http400"])
    session = f"early-{uuid.uuid4().hex[:6]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    response = post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert response.status_code == 400
    assert records(record_dir, session) == ([], {})
    # The stream was open (its relay connected) before the failure came: the agent still reads what a whole turn's
    # failure answers.
    replica.set_faults(["render:http400"])
    whole = post(proxy.url + "/v1/chat/completions", json={**body, "stream": False}, headers={"x-session-id": session})
    assert (whole.status_code, whole.json()) == (response.status_code, response.json())
    assert response.headers["content-type"] == whole.headers["content-type"]
    assert records(record_dir, session) == ([], {})


def test_a_failure_mid_stream_ends_with_an_error_event_and_records_nothing(stack) -> None:
    replica, proxy, record_dir = stack
    replica.backend.reset()
    replica.set_faults(["generate:logprobs_length"])
    session = f"mid-{uuid.uuid4().hex[:6]}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    response = post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
    data = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
    assert data and "[DONE]" not in data
    assert "nothing was recorded" in json.loads(data[-1])["error"]["message"]
    assert records(record_dir, session) == ([], {})
    with pytest.raises(openai.APIError):
        replica.set_faults(["generate:logprobs_length"])
        with client(proxy, session).chat.completions.stream(model=MODEL, messages=body["messages"]) as events:
            for _ in events:
                pass
    # Both generations end in the replica when it next writes to a stream the proxy abandoned, which may be after
    # this test: wait for them, so no later test counts them as its own.
    deadline = time.monotonic() + 20
    while replica.backend.cancelled_streams + replica.backend.completed_streams < 2 and time.monotonic() < deadline:
        time.sleep(0.05)


def test_an_agent_that_hangs_up_cancels_the_generation_and_nothing_is_recorded(stack) -> None:
    replica, proxy, record_dir = stack
    replica.backend.reset()
    replica.backend.reset()
    session = f"gone-{uuid.uuid4().hex[:6]}"
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "stream": True})  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    connection.request(
        "POST", "/v1/chat/completions", body, {"content-type": "application/json", "x-session-id": session}
    )
    response = connection.getresponse()
    assert response.status == 200
    first = response.readline()
    assert first.startswith(b"data: ")
    # The agent hangs up after the first chunk: the response's reader holds the socket open too (a socket closes when
    # its last reference does), so both go.
    connection.sock.close()
    response.close()
    deadline = time.monotonic() + 20
    while replica.backend.cancelled_streams == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert replica.backend.cancelled_streams == 1 and replica.backend.completed_streams == 0
    time.sleep(0.5)
    assert records(record_dir, session) == ([], {})
    # The session is untouched: the same request, not streamed, is its first turn.
    follow = post(proxy.url + "/v1/chat/completions", json=dict(json.loads(body), stream=False),
                  headers={"x-session-id": session})  # fmt: skip
    assert follow.status_code == 200
    turns, _ = records(record_dir, session)
    assert [t.turn_id for t in turns] == [0]


def test_an_agent_that_hangs_up_before_the_first_chunk_cancels_the_generation_at_once(tmp_path: Path) -> None:
    """The agent's connection to the relay is made while the backend is still before its first chunk (the relay's
    setup overlaps the prefill): an agent that hangs up then stops the generation at once, not once that chunk comes,
    and nothing is recorded."""
    first_chunk_s = 4.0  # the first chunk waits for its derender this long
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), stream_delay_s=0.05, derender_delay_s=first_chunk_s)
    with VllmReplicaThread(config) as replica, vllm_proxy(replica.url, tmp_path / "rec", tmp_path) as proxy:
        session = f"early-gone-{uuid.uuid4().hex[:6]}"
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
                           "stream": True, "max_tokens": 200})  # fmt: skip
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        connection.request(
            "POST", "/v1/chat/completions", body, {"content-type": "application/json", "x-session-id": session}
        )
        deadline = time.monotonic() + 10
        while (
            not any(path.endswith("/generate") for path, _ in replica.backend.received_copy())
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        time.sleep(0.3)  # the generation streams on; its first derender is pending
        connection.sock.close()
        hung_up = time.monotonic()
        while replica.backend.cancelled_streams == 0 and time.monotonic() < hung_up + 2 * first_chunk_s:
            time.sleep(0.02)
        assert replica.backend.cancelled_streams == 1 and replica.backend.completed_streams == 0
        assert time.monotonic() - hung_up < first_chunk_s / 2
        assert records(tmp_path / "rec", session) == ([], {})


def test_backends_that_cannot_stream_exact_ids_get_a_reframed_stream(tmp_path: Path) -> None:
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), version="0.24.0")
    with VllmReplicaThread(config) as old, vllm_proxy(old.url, tmp_path / "rec", tmp_path) as proxy:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        response = post(proxy.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers["x-tito-stream"] == "reframed"
        assert response.text.rstrip().endswith("data: [DONE]")


def test_sglang_streams_live_with_sglext_ids_and_records_what_a_whole_turn_records(tmp_path: Path) -> None:
    from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

    record_dir = tmp_path / "rec"
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path
    ) as proxy:  # fmt: skip
        for first in ("Weather in Paris?", "Tell me about Oslo."):
            whole, live = f"whole-{uuid.uuid4().hex[:6]}", f"live-{uuid.uuid4().hex[:6]}"
            messages = [{"role": "user", "content": first}]
            plain = client(proxy, whole).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
            raw = post(proxy.url + "/v1/chat/completions", headers={"x-session-id": live},
                       json={"model": MODEL, "messages": messages, "tools": TOOLS, "stream": True})  # fmt: skip
            assert raw.headers["x-tito-stream"] == "live"
            with client(proxy, f"{live}-sdk").chat.completions.stream(
                model=MODEL, messages=messages, tools=TOOLS
            ) as events:
                for _ in events:
                    pass
                streamed = events.get_final_completion()
            _, whole_ids = records(record_dir, whole)
            _, live_ids = records(record_dir, live)
            _, sdk_ids = records(record_dir, f"{live}-sdk")
            assert whole_ids == live_ids == sdk_ids
            a, b = plain.choices[0], streamed.choices[0]
            assert a.finish_reason == b.finish_reason and a.message.content == b.message.content
            assert getattr(a.message, "reasoning_content", None) == getattr(b.message, "reasoning_content", None)
            assert [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []] == [
                (c.function.name, c.function.arguments) for c in b.message.tool_calls or []
            ]
        streamed_bodies = [body for body in replica.received() if body.get("stream")]
        assert streamed_bodies and all(body["return_output_ids_in_sglext"] for body in streamed_bodies)
        assert all("return_meta_info" not in body for body in streamed_bodies)


def test_sglang_before_0_5_20_gets_a_reframed_stream(tmp_path: Path) -> None:
    from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), version="0.5.18")
    with ReplicaThread(config) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path
    ) as proxy:  # fmt: skip
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
        response = post(proxy.url + "/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers["x-tito-stream"] == "reframed"
        assert all(b.get("stream") is False for b in replica.received())


@pytest.mark.parametrize("first", ["Weather in Paris?", "Tell me about Zürich ☃ and Tōkyō."])
def test_a_busy_derender_gets_merged_chunks_and_the_agent_the_same_message(tmp_path: Path, first: str) -> None:
    """A slow streaming derender: the generate chunks that arrive during a call go to the next call as one merged
    chunk (at most one call in flight), so there are fewer calls than tokens, and the streamed message — content,
    reasoning, tool calls (their tags split across chunks), multi-byte characters — is the whole turn's."""
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), stream_delay_s=0.002, derender_delay_s=0.03)
    with (
        VllmReplicaThread(config) as replica,
        vllm_proxy(replica.url, tmp_path / "rec", tmp_path) as proxy,
    ):
        messages = [{"role": "user", "content": first}]
        plain = client(proxy, "whole").chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, seed=3)
        with client(proxy, "live").chat.completions.stream(
            model=MODEL, messages=messages, tools=TOOLS, seed=3
        ) as events:
            for _ in events:
                pass
            streamed = events.get_final_completion()
        calls = [body for path, body in replica.received() if path.endswith("/derender") and body.get("stream")]
    whole_turns, whole_ids = records(tmp_path / "rec", "whole")
    live_turns, live_ids = records(tmp_path / "rec", "live")
    assert live_ids == whole_ids and live_turns[0].completion_logprobs == whole_turns[0].completion_logprobs
    sizes = [len(call["generate_chunk"]["choices"][0]["token_ids"]) for call in calls]
    assert sum(sizes) == len(live_ids[0][1]), "every generated token was derendered exactly once, in order"
    assert [t for call in calls for t in call["generate_chunk"]["choices"][0]["token_ids"]] == live_ids[0][1]
    assert max(sizes) > 1 and len(calls) < len(live_ids[0][1]), f"chunks were merged: {sizes}"
    a, b = plain.choices[0], streamed.choices[0]
    assert (a.finish_reason, a.message.content) == (b.finish_reason, b.message.content)
    assert (a.message.model_extra or {}).get("reasoning") == (b.message.model_extra or {}).get("reasoning")
    assert [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []] == [
        (c.function.name, c.function.arguments) for c in b.message.tool_calls or []
    ]


@pytest.mark.parametrize("merge", [True, False])
async def test_families_whose_parsers_depend_on_chunking_keep_one_derender_call_per_chunk(merge: bool) -> None:
    """`merge_stream_chunks` off (deepseek-r1, mistral, default): one streaming derender call per generate chunk,
    however busy the server; on: fewer calls than chunks. The same ids, and the whole turn's message either way,
    though call boundaries fall inside a multi-byte character and inside the tool call's tags."""
    from tito_addon.backends.backend_protocol import BackendTurn
    from tito_addon.backends.upstream_client import UpstreamClient
    from tito_addon.backends.vllm_backend import VllmBackend
    from tito_addon.engine.prompt_ids import PromptIds

    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), stream_delay_s=0.002, derender_delay_s=0.03)
    with VllmReplicaThread(config) as replica:
        client = UpstreamClient()
        backend = VllmBackend(client, merge_stream_chunks=merge)
        from support.basics import cached_engine

        from tito_addon.canonical_chat import ChatRequest

        content = "Wetter in Zürich? 東京 und Café, bitte."
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "tools": TOOLS}
        request = ChatRequest.model_validate(body)
        engine = cached_engine("qwen3")
        prompt = engine.first_turn(request.messages, request.tools, {}).ids
        turn = BackendTurn(replica.url, "/v1/chat/completions", body, PromptIds(None, list(prompt)), {})
        events = [event async for event in backend.stream_turn(turn)]
        calls = [b for path, b in replica.received() if path.endswith("/derender") and b.get("stream")]
        generated = [b for path, b in replica.received() if path.endswith("/generate")]
        whole = await backend.run_turn(turn)
        await client.close()
    end = events[-1]
    completion = end.result.completion_ids
    assert completion == whole.completion_ids and end.result.completion_logprobs == whole.completion_logprobs
    streamed = end.result.message
    fields = ("reasoning", "content")
    assert [streamed.get(k) for k in fields] == [whole.message.get(k) for k in fields]
    assert "東京" in streamed["reasoning"] and "\ufffd" not in streamed["reasoning"]
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in whole.message["tool_calls"]]
    sizes = [len(call["generate_chunk"]["choices"][0]["token_ids"]) for call in calls]
    assert sum(sizes) == len(completion) and len(generated) == 1
    tokenizer = engine.tokenizer
    split_characters = [k for k in range(1, len(completion)) if tokenizer.decode(completion[:k]).endswith("\ufffd")]
    opens, closes = (completion.index(tokenizer.convert_tokens_to_ids(t)) for t in ("<tool_call>", "</tool_call>"))
    assert split_characters and opens + 1 < closes, "the completion has a character split across two tokens"
    assert all(call["generate_chunk"]["prompt_token_ids"] is None for call in calls), "the prompt echo stays here"
    if merge:
        assert max(sizes) > 1 and len(calls) < len(completion), sizes
    else:
        assert set(sizes) == {1} and len(calls) == len(completion), sizes  # a call ends at every token boundary


def test_many_first_turns_streamed_at_once_on_a_fresh_proxy_all_stream(tmp_path: Path) -> None:
    """The live server starts on the first streamed turn: turns that arrive together all wait for that one start (two
    starts at once had one agent answered 500, seen against a real vLLM)."""
    from concurrent.futures import ThreadPoolExecutor

    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), stream_delay_s=0.01)
    with VllmReplicaThread(config) as replica, vllm_proxy(replica.url, tmp_path / "rec", tmp_path) as proxy:

        def stream(i: int) -> str:
            session = f"first-{i}"
            agent = client(proxy, session).with_options(max_retries=0)  # a 500 must not pass as its retry
            with agent.chat.completions.stream(
                model=MODEL, messages=[{"role": "user", "content": f"Weather in city {i}?"}], seed=i
            ) as events:
                assert sum(event.type == "chunk" for event in events) > 1
            return session

        with ThreadPoolExecutor(12) as pool:
            sessions = list(pool.map(stream, range(12)))
        for session in sessions:
            turns, _ = records(tmp_path / "rec", session)
            assert len(turns) == 1, session
