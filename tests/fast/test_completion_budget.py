"""What the backend serves, honoured (issue 30, part): a completion budget past its context is cut to what the
context leaves after the prompt, and a side call under a model name it does not serve runs under the one it does.

Claude Code asks for `max_tokens` up to 128k whatever the model serves. Through a real mitmdump, a budget past the
context reaches the server as the largest it accepts (the context less the prompt, less one), the record says what
was asked and what was sent, and the agent gets its answer instead of the server's refusal. The servers' context
comes from `/v1/models` (`max_model_len`, asked once per backend); both replicas refuse, in their server's own
words, what passes it, as sglang and vLLM do. A prompt that leaves no room is a 400 with nothing forwarded.
"""

from __future__ import annotations

import anthropic
import openai
import pytest
from support.basics import tokenizer_path
from support.proxy_harness import Mitmdump

from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread
from tito_addon.tito_errors import BadRequest
from tito_addon.turns.completion_budget import fit_completion_budget

CONTEXT = 2048
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_budget_is_cut_only_past_the_room_the_context_leaves() -> None:
    body = {"max_tokens": 500, "max_completion_tokens": 900, "temperature": 0}
    assert fit_completion_budget(body, 1000, None) is None and body["max_tokens"] == 500  # context unknown
    assert fit_completion_budget(body, 1000, 2048) is None and body == {
        "max_tokens": 500, "max_completion_tokens": 900, "temperature": 0,
    }  # fmt: skip
    note = fit_completion_budget(body, 1500, 2048)
    assert note == {"asked": 900, "sent": 547, "context_length": 2048}
    assert body == {"max_tokens": 500, "max_completion_tokens": 547, "temperature": 0}
    assert fit_completion_budget({"max_tokens": True}, 2000, 2048) is None  # not a count
    assert fit_completion_budget({}, 2000, 2048) is None  # no budget asked: the server's own default
    with pytest.raises(BadRequest, match="no room is left for a completion"):
        fit_completion_budget({"max_tokens": 1}, 2047, 2048)


@pytest.fixture(scope="module")
def sglang():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), context_length=CONTEXT)) as replica:
        yield replica


@pytest.fixture(scope="module")
def proxy(sglang, tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("rec")
    with Mitmdump(sglang.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent) as run:
        yield run


def turns_of(proxy: Mitmdump, session: str) -> list:
    path = proxy.record_dir / session_file_name(session)
    return read_session_file(path).turns if path.exists() else []


def test_the_replica_refuses_what_passes_its_context_as_sglang_does(sglang) -> None:
    client = openai.OpenAI(base_url=sglang.url + "/v1", api_key="k", max_retries=0)
    assert client.models.list().data[0].model_extra["max_model_len"] == CONTEXT
    with pytest.raises(openai.BadRequestError, match="exceeds the model's maximum context length of 2048 tokens"):
        client.chat.completions.create(model="m", messages=ASK, max_tokens=CONTEXT)


def test_a_budget_past_the_context_is_cut_and_recorded(sglang, proxy) -> None:
    sglang.backend.reset()
    client = openai.OpenAI(
        base_url=proxy.url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "budget"}
    )
    reply = client.chat.completions.create(model="m", messages=ASK, max_tokens=128_000)
    assert reply.choices[0].message.content
    (turn,) = turns_of(proxy, "budget")
    room = CONTEXT - turn.prompt_len - 1
    assert turn.completion_budget is not None
    assert turn.completion_budget.model_dump() == {"asked": 128_000, "sent": room, "context_length": CONTEXT}
    (received,) = sglang.received()
    assert received["max_tokens"] == room and len(received["input_ids"]) == turn.prompt_len
    # A budget that fits goes as asked, and the record says nothing of it.
    client.chat.completions.create(model="m", messages=ASK, max_tokens=64)
    assert sglang.received()[-1]["max_tokens"] == 64
    assert turns_of(proxy, "budget")[-1].completion_budget is None


def test_claude_codes_budget_is_served(sglang, proxy) -> None:
    sglang.backend.reset()
    client = anthropic.Anthropic(
        base_url=proxy.url, api_key="k", max_retries=0, default_headers={"x-session-id": "budget-messages"}
    )
    with client.messages.stream(model="m", max_tokens=128_000, messages=ASK) as stream:  # streamed, as Claude Code
        reply = stream.get_final_message()
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content
    (turn,) = turns_of(proxy, "budget-messages")
    assert turn.completion_budget is not None and turn.completion_budget.asked == 128_000
    assert sglang.received()[-1]["max_tokens"] == CONTEXT - turn.prompt_len - 1


def test_a_prompt_that_fills_the_context_is_refused_and_nothing_is_forwarded(sglang, proxy) -> None:
    sglang.backend.reset()
    client = openai.OpenAI(
        base_url=proxy.url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "no-room"}
    )
    long = [{"role": "user", "content": "weather " * CONTEXT}]
    with pytest.raises(openai.BadRequestError, match="no room is left for a completion") as refused:
        client.chat.completions.create(model="m", messages=long, max_tokens=16)
    assert refused.value.status_code == 400
    with pytest.raises(openai.BadRequestError, match="no room is left for a completion"):  # the live stream's path
        client.chat.completions.create(model="m", messages=long, max_tokens=16, stream=True)
    assert sglang.received() == [] and turns_of(proxy, "no-room") == []


def test_vllm_budgets_are_cut_to_max_model_len(tmp_path) -> None:
    config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), version="0.32.0", max_model_len=CONTEXT)
    with VllmReplicaThread(config) as vllm:
        record_dir = tmp_path / "rec"
        options = {"tito_backend_kind": "vllm"}
        with Mitmdump(vllm.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                      options=options) as run:  # fmt: skip
            client = openai.OpenAI(
                base_url=run.url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "vllm-budget"}
            )
            reply = client.chat.completions.create(model="tiny-qwen3", messages=ASK, max_tokens=100_000)
            assert reply.choices[0].message is not None
            # A side call under the agent's own small-model alias (vLLM answers 404 to a name it does not serve),
            # whole and streamed: served under the one model there is, recorded under both names.
            side = openai.OpenAI(
                base_url=run.url + "/v1", api_key="k", max_retries=0, default_headers={"x-session-id": "vllm-side"}
            )
            served = side.chat.completions.create(model="claude-haiku-4-5", messages=ASK, max_tokens=64)
            assert served.choices[0].message is not None
            chunks = list(side.chat.completions.create(model="claude-haiku-4-5", messages=ASK, max_tokens=64,
                                                       stream=True))  # fmt: skip
            assert chunks
        (turn,) = turns_of(run, "vllm-budget")
        assert turn.completion_budget is not None
        assert turn.completion_budget.model_dump() == {
            "asked": 100_000, "sent": CONTEXT - turn.prompt_len - 1, "context_length": CONTEXT,
        }  # fmt: skip
        assert turn.served_model is None  # the name it served
        side_turns = turns_of(run, "vllm-side")
        assert [(t.model, t.served_model) for t in side_turns] == [("claude-haiku-4-5", "tiny-qwen3")] * 2
        # What crossed the wire to render and derender (generate takes the render's answer): the served name only.
        names = {body.get("model") for path, body in vllm.received() if path.endswith(("/render", "/derender"))}
        assert names == {"tiny-qwen3"}, names
