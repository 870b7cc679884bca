"""The token engine on the real Qwen tokenizers: incremental prompts extend the stored ids exactly and equal
a from-scratch render wherever the template is append-only; sampled ids a re-render would change survive."""

from __future__ import annotations

import json

import pytest
from support.basics import SHARED, TOOLS, cached_engine

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.model_families import FAMILIES
from tito_addon.engine.template_messages import template_message
from tito_addon.engine.token_engine import TokenEngine
from tito_addon.engine.tokenizer_loading import rust_fast_path
from tito_addon.tito_errors import BadRequest, TokenizationError


def call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def M(**kw) -> ChatMessage:
    return ChatMessage.model_validate(kw)


# (appended messages, the assistant reply) per turn: reasoning, parallel calls, tool results, user turns.
CONVERSATION = [
    (
        [
            M(role="system", content="You are a careful travel agent."),
            M(role="user", content="Weather in Paris and Oslo?"),
        ],
        M(
            role="assistant",
            content="",
            reasoning_content="Two cities, so two parallel calls.",
            tool_calls=[
                call("call_1", "get_weather", {"city": "Paris"}),
                call("call_2", "get_weather", {"city": "Oslo"}),
            ],
        ),
    ),
    (
        [
            M(role="tool", tool_call_id="call_1", name="get_weather", content='{"temp_c": 21, "sky": "clear"}'),
            M(role="tool", tool_call_id="call_2", name="get_weather", content='{"temp_c": -3, "sky": "snow"}'),
        ],
        M(role="assistant", content="Paris: 21 °C, clear. Oslo: −3 °C with snow.", reasoning_content="Summarise both."),
    ),
    (
        [M(role="user", content="Find me a café in Oslo.")],
        M(
            role="assistant",
            content="",
            reasoning_content="Search.",
            tool_calls=[call("call_3", "search", {"q": "café Oslo"})],
        ),
    ),
    (
        [M(role="tool", tool_call_id="call_3", name="search", content="Fuglen, Tim Wendelboe")],
        M(role="assistant", content="Try Fuglen or Tim Wendelboe.", reasoning_content="Two good picks."),
    ),
    (
        [M(role="system", content="Answer in one line."), M(role="user", content="Thanks! 谢谢")],
        M(role="assistant", content="You're welcome!", reasoning_content="Short reply."),
    ),
]


def canonical_completion(
    engine: TokenEngine, history: list[ChatMessage], reply: ChatMessage, kwargs: dict
) -> list[int]:
    """The ids a model emits for `reply`: its canonical rendering, ending at the stop token (no trailing newline)."""
    before = engine.render([template_message(m) for m in history], TOOLS, add_generation_prompt=True, kwargs=kwargs)
    after = engine.render(
        [template_message(m) for m in history + [reply]], TOOLS, add_generation_prompt=False, kwargs=kwargs
    )
    assert after.startswith(before)
    text = after[len(before) :]
    assert text.endswith("<|im_end|>\n")
    return engine.encode(text[: -len("\n")])


def run_conversation(engine: TokenEngine, kwargs: dict):
    history: list[ChatMessage] = []
    stored: list[int] | None = None
    completion: list[int] = []
    prompts = []
    for appended, reply in CONVERSATION:
        if kwargs.get("enable_thinking") is False:
            reply = reply.model_copy(update={"reasoning_content": None})  # no thinking: no reasoning sampled
        if stored is None:
            piece = engine.first_turn(history + appended, TOOLS, kwargs)
            prompt = piece.ids
        else:
            piece = engine.continuation(completion, appended, TOOLS, kwargs)
            prompt = stored + piece.ids
            assert prompt[: len(stored)] == stored, "the prompt must start with the previous prompt + completion"
        assert piece.segments[-1].end == len(piece.ids)
        history = history + appended
        scratch = engine.encode(
            engine.render([template_message(m) for m in history], TOOLS, add_generation_prompt=True, kwargs=kwargs)
        )
        prompts.append((prompt, scratch, piece))
        completion = canonical_completion(engine, history, reply, kwargs)
        history.append(reply)
        stored = prompt + completion
    return prompts


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
@pytest.mark.parametrize("thinking", [True, False])
def test_incremental_equals_from_scratch(family: str, thinking: bool) -> None:
    engine = cached_engine(family)
    kwargs = {} if thinking else {"enable_thinking": False}
    prompts = run_conversation(engine, kwargs)
    assert len(prompts) == len(CONVERSATION)
    for turn, (prompt, scratch, _) in enumerate(prompts):
        assert prompt == scratch, f"turn {turn}: incremental prompt differs from a from-scratch render"


def test_segments_name_their_sources(qwen3_engine: TokenEngine) -> None:
    prompts = run_conversation(qwen3_engine, {})
    tok = qwen3_engine.tokenizer
    assert [s.source for s in prompts[0][2].segments] == ["render"]
    assert [s.source for s in prompts[1][2].segments] == ["boundary", "messages", "generation_prompt"]
    piece = prompts[1][2]
    boundary, messages, generation = (piece.ids[s.start : s.end] for s in piece.segments)
    assert boundary == tok.encode("\n", add_special_tokens=False)
    text = tok.decode(messages)
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 1
    assert tok.decode(generation) == "<|im_start|>assistant\n"


def test_generation_prompt_follows_request_kwargs(qwen3_engine: TokenEngine) -> None:
    completion = qwen3_engine.encode("Hi.<|im_end|>")
    on = qwen3_engine.continuation(completion, [M(role="user", content="x")], None, {})
    off = qwen3_engine.continuation(completion, [M(role="user", content="x")], None, {"enable_thinking": False})
    assert qwen3_engine.tokenizer.decode(off.ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3_engine.tokenizer.decode(on.ids).endswith("<|im_start|>assistant\n")


def test_stock_qwen3_template_keeps_no_history_think_blocks_but_ours_does(qwen3_engine: TokenEngine) -> None:
    """Why the qwen3 family ships its own template: the stock one rewrites earlier turns on a user append."""
    history = [template_message(m) for appended, reply in CONVERSATION[:2] for m in appended + [reply]]
    history += [template_message(m) for m in CONVERSATION[2][0]]  # a later user query
    stock = qwen3_engine.tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False)
    assert "Two cities, so two parallel calls." not in stock
    ours = qwen3_engine.render(history, TOOLS, add_generation_prompt=False, kwargs={})
    assert "Two cities, so two parallel calls." in ours


def test_boundary_rules(qwen3_engine: TokenEngine) -> None:
    im_end = qwen3_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = qwen3_engine.encode("\n")[0]
    assert qwen3_engine.boundary_ids([5, im_end]) == [newline]
    assert qwen3_engine.boundary_ids([5, im_end, newline]) == []
    # A completion cut off by max_tokens is closed, never glued onto the next message.
    assert qwen3_engine.boundary_ids([5, 6]) == [im_end, newline]


def test_disallowed_role_is_rejected_before_any_rendering() -> None:
    engine = cached_engine("qwen3", "qwen3", ("tool",))
    with pytest.raises(BadRequest, match="tito_append_roles"):
        engine.continuation([1], [M(role="user", content="hi")], None, {})


def test_forbidden_request_kwargs(qwen3_engine: TokenEngine) -> None:
    with pytest.raises(BadRequest, match="chat_template"):
        qwen3_engine.effective_kwargs({"chat_template": "{{ 7*7 }}"})
    assert qwen3_engine.effective_kwargs({"enable_thinking": False}) == {"enable_thinking": False}


def test_default_family_probe() -> None:
    """`default` on the stock Qwen3 template is refused with a message naming the family to use."""
    from support.basics import cached_tokenizer, tokenizer_path

    engine = TokenEngine(cached_tokenizer("qwen3"), FAMILIES["default"], tokenizer_name=tokenizer_path("qwen3"))
    with pytest.raises(ValueError, match="tito_model_family=qwen3"):
        engine.check_append_only()
    qwen25_default = TokenEngine(
        cached_tokenizer("qwen2.5"), FAMILIES["default"], tokenizer_name=tokenizer_path("qwen2.5")
    )
    qwen25_default.check_append_only()  # the Qwen2.5 template is append-only as shipped
    cached_engine("qwen3").check_append_only()


def test_template_failure_is_a_tokenization_error(qwen3_engine: TokenEngine) -> None:
    engine = TokenEngine(qwen3_engine.tokenizer, FAMILIES["qwen3"], tokenizer_name=qwen3_engine.tokenizer_name)
    engine.template = "{{ raise_exception('nope') }}"
    with pytest.raises(TokenizationError, match="nope"):
        engine.first_turn([M(role="user", content="x")], None, {})


def drift_cases(family: str) -> list[dict]:
    path = SHARED / "drift_cases" / f"{family}.jsonl"
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
def test_drift_cases_survive_into_the_next_prompt(family: str) -> None:
    """Each case's ids (which re-tokenizing or re-rendering changes) reach the next prompt unchanged."""
    engine = cached_engine(family)
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    cases = drift_cases(family)
    assert len(cases) >= 20
    for case in cases:
        ids = case["ids"]
        assert ids != case["canonical_ids"]
        first = engine.first_turn([M(role="user", content="Go on.")], None, {}).ids
        completion = ids if ids[-1] == im_end else ids + [im_end]
        follow = engine.continuation(completion, [M(role="user", content="Next?")], None, {})
        prompt = first + completion + follow.ids
        assert prompt[len(first) : len(first) + len(ids)] == ids, case["kind"]
        # ...whereas the re-tokenizing pipeline would have changed them.
        assert engine.encode(engine.tokenizer.decode(ids)) != ids or "messages" in case, case["kind"]


def test_continuation_cost_does_not_grow_with_history(monkeypatch) -> None:
    """What a continuation renders and tokenizes is independent of the history length (no timing involved)."""
    engine = cached_engine("qwen3")
    rendered: list[int] = []
    encoded: list[int] = []
    real_render, real_encode = engine.render, engine.encode
    monkeypatch.setattr(engine, "render", lambda *a, **k: rendered.append(len(r := real_render(*a, **k))) or r)
    monkeypatch.setattr(engine, "encode", lambda text: encoded.append(len(text)) or real_encode(text))
    appended = [M(role="tool", tool_call_id="call_1", name="search", content="result " * 50)]
    engine.continuation([engine.end_of_turn_ids[0]], appended, TOOLS, {})  # the same warm caches for every length
    costs = []
    for history_tokens in (10, 10_000, 200_000):
        rendered.clear()
        encoded.clear()
        completion = list(range(1000, 1000 + history_tokens)) + [engine.end_of_turn_ids[0]]
        engine.continuation(completion, appended, TOOLS, {})
        costs.append((sum(rendered), sum(encoded)))
    assert costs[0] == costs[1] == costs[2]


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "deepseek-r1", "gpt-oss", "mistral"])
def test_the_rust_fast_path_gives_the_wrappers_ids(family: str) -> None:
    engine = cached_engine(family, roles=("tool", "user"))
    assert engine._fast is not None
    texts = [json.loads(line)["text"] for line in (SHARED / "tokenizers" / "render_examples.jsonl").open()]
    for path in (SHARED / "drift_cases").glob("*.jsonl"):
        for line in path.open():
            texts += [v for v in json.loads(line).values() if isinstance(v, str)]
    assert len(texts) > 400
    for text in texts:
        assert engine.encode(text) == list(engine.tokenizer.encode(text, add_special_tokens=False)), text[:80]


def test_a_fast_path_that_disagrees_is_not_used() -> None:
    """A Rust tokenizer that splits differently from its wrapper (here: Qwen2.5's, which lacks Qwen3's <think>
    tokens, under the Qwen3 wrapper) is caught by the startup probe and never used."""
    engine = cached_engine("qwen3")
    other = cached_engine("qwen2.5").tokenizer._tokenizer

    class Wrapper:
        def __init__(self, tokenizer):
            self._tokenizer = other
            self.encode = tokenizer.encode
            self.all_special_tokens = tokenizer.all_special_tokens

    assert rust_fast_path(engine.tokenizer, engine.template) is engine._fast is not None
    assert rust_fast_path(Wrapper(engine.tokenizer), engine.template) is None
