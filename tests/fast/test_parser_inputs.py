"""What vLLM's derender is sent: a seed of the prompt that answers every "which special token came last?" scan and
seeds the detokenizer like the whole prompt, the chat request without its messages, and when a streamed batch is
due. The end-to-end checks (same message, merged calls, real vLLM) are in test_live_streaming and tests/e2e."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.basics import cached_engine, examples
from support.seed_reference import expected_seed

from tito_addon.backends.chunk_batches import due
from tito_addon.backends.parser_inputs import PROMPT_TAIL, derender_chat_request, prompt_seed, sglang_messages
from tito_addon.engine.model_families import FAMILIES

SPECIAL = frozenset({100, 101, 102, 103})


def last_special(ids: list[int], special: frozenset[int]) -> int | None:
    """A reasoning parser's backward scan: which of its tokens came last."""
    return next((t for t in reversed(ids) if t in special), None)


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(st.integers(min_value=95, max_value=105), max_size=80), st.integers(min_value=0, max_value=20))
def test_seed_equals_the_reference_and_answers_every_backward_scan(ids: list[int], tail: int) -> None:
    seed = prompt_seed(ids, SPECIAL, tail)
    assert seed == expected_seed(ids, SPECIAL, tail)
    assert seed[len(seed) - min(tail, len(ids)) :] == ids[len(ids) - min(tail, len(ids)) :]
    for subset in ({100, 101}, {102}, SPECIAL, {100, 103}):
        assert last_special(seed, frozenset(subset)) == last_special(ids, frozenset(subset))
    assert set(seed) & SPECIAL == set(ids) & SPECIAL


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "deepseek-r1", "gpt-oss", "mistral"])
def test_the_seed_of_a_real_prompt_keeps_the_markers_the_parsers_look_for(family: str) -> None:
    engine = cached_engine(family, roles=("tool", "user"))
    tokenizer = engine.tokenizer
    markers = {
        "qwen3": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"],
        "qwen2.5": ["<tool_call>", "</tool_call>", "<|im_start|>", "<|im_end|>"],
        "deepseek-r1": ["<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜Assistant｜>"],
        "gpt-oss": ["<|channel|>", "<|start|>", "<|message|>", "<|end|>"],
        "mistral": ["[INST]", "[/INST]", "[TOOL_CALLS]"],
    }[family]
    marker_ids = [tokenizer.convert_tokens_to_ids(m) for m in markers]
    assert set(marker_ids) <= engine.special_ids, "every marker a parser scans for is an added token"
    filler = tokenizer.encode(" plain words" * 50, add_special_tokens=False)
    prompt = [t for marker in marker_ids for t in [marker, *filler]] + filler
    seed = prompt_seed(prompt, engine.special_ids)
    assert seed == expected_seed(prompt, engine.special_ids)
    assert len(seed) == len(marker_ids) + PROMPT_TAIL < len(prompt) // 10
    assert seed[: len(marker_ids)] == marker_ids


def test_only_known_families_send_a_compact_requests() -> None:
    assert {name for name, family in FAMILIES.items() if family.compact_requests} == {
        "qwen3", "qwen2.5", "qwen2.5-vl", "qwen3-vl", "deepseek-r1", "gpt-oss", "mistral"
    }  # fmt: skip


def test_the_chat_request_loses_its_messages_and_on_033_streams_its_stop() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x" * 1000}], "tools": [{"type": "function"}],
            "tool_choice": "auto", "stop": ["END"], "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    assert derender_chat_request(chat, compact=False, streaming=True, refuses_stop=False) is chat
    compact = derender_chat_request(chat, compact=True, streaming=False, refuses_stop=True)
    assert compact == {**chat, "messages": [{"role": "user", "content": ""}]}
    streamed = derender_chat_request(chat, compact=True, streaming=True, refuses_stop=True)
    assert "stop" not in streamed and streamed["tools"] == chat["tools"]
    full = derender_chat_request(chat, compact=False, streaming=True, refuses_stop=True)
    assert full["messages"] == chat["messages"] and "stop" not in full
    assert chat["stop"] == ["END"] and len(chat["messages"][0]["content"]) == 1000, "the agent's body is untouched"


def chunk(tokens: int, finish: str | None = None) -> dict:
    return {"choices": [{"token_ids": list(range(tokens)), "finish_reason": finish}]}


def test_a_batch_is_due_when_it_grew_by_a_quarter_of_what_was_sent_or_the_generation_ended() -> None:
    assert due([chunk(1)], 0), "the first token goes at once"
    assert not due([chunk(24)], 100) and due([chunk(25)], 100)
    assert due([chunk(10), chunk(15)], 100)
    assert due([chunk(1), chunk(0, "stop")], 1000), "the end is never held back"
    assert due([chunk(0, "length")], 10)


def test_the_calls_of_a_long_turn_grow_logarithmically() -> None:
    sent, calls, waiting = 0, 0, 0
    for _ in range(2000):  # one token per generate chunk
        waiting += 1
        if due([chunk(waiting)], sent):
            sent, waiting, calls = sent + waiting, 0, calls + 1
    assert sent + waiting == 2000 and calls < 40, calls


def test_sglang_is_sent_only_the_messages_it_reads_given_input_ids() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "x" * 500},
        {"role": "assistant", "content": "Sure"},
    ]
    placeholder = [{"role": "user", "content": ""}]
    assert sglang_messages(history, None) == placeholder
    assert sglang_messages(history, False) == placeholder
    assert sglang_messages(history, "true") == placeholder, "only a real true continues the prefill"
    assert sglang_messages(history, True) == [history[-1]], "the prefill whose think tags its parser checks"
    assert sglang_messages(history[:2], True) == placeholder, "nothing to continue after a user message"
    tooled = {"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]}
    developer = {"role": "developer", "content": "d", "tools": [{"type": "function", "function": {"name": "g"}}]}
    assert sglang_messages([tooled, *history, developer, {"role": "user", "content": "q"}], False) == [
        tooled, developer, *placeholder
    ]  # fmt: skip
    assert sglang_messages([{**history[0], "tools": []}, history[1]], False) == placeholder


def test_the_sglang_body_keeps_the_conversation_for_an_unknown_family() -> None:
    from tito_addon.backends.backend_protocol import BackendTurn
    from tito_addon.backends.sglang_backend import SglangBackend
    from tito_addon.backends.upstream_client import UpstreamClient
    from tito_addon.engine.prompt_ids import PromptIds

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}
    turn = BackendTurn("http://x", "/v1/chat/completions", body, PromptIds.of([1, 2, 3]), {})
    client = UpstreamClient()
    compact = SglangBackend(client, compact_requests=True).upstream_body(turn)
    whole = SglangBackend(client, compact_requests=False).upstream_body(turn)
    assert compact["messages"] == [{"role": "user", "content": ""}] and compact["tools"] == body["tools"]
    assert whole["messages"] == body["messages"] and body["messages"][0]["content"] == "hi"
    assert {k: v for k, v in compact.items() if k != "messages"} == {k: v for k, v in whole.items() if k != "messages"}
