"""deepseek-r1, gpt-oss (harmony) and mistral on their real tokenizers: every prompt extends the previous prompt +
completion ids exactly, equals a from-scratch render of the family's (fixed) template, and keeps every drift
case of the family; boundary rules, reasoning handling and what each family refuses are pinned here."""

from __future__ import annotations

import json

import pytest
from support.basics import SHARED, TOOLS, cached_tokenizer, tokenizer_path

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.model_families import FAMILIES, GPT_OSS_PINNED_DATE, suggest_family
from tito_addon.engine.template_messages import template_message
from tito_addon.engine.token_engine import TokenEngine
from tito_addon.tito_errors import TemplateRefusal, TokenizationError

FAMILY_NAMES = ("deepseek-r1", "gpt-oss", "mistral")
# DeepSeek and Mistral place system messages at the start only: their engines append tool and user messages.
ROLES = {"deepseek-r1": ("tool", "user"), "gpt-oss": ("tool", "user", "system"), "mistral": ("tool", "user")}
_ENGINES: dict[str, TokenEngine] = {}


def engine_for(family: str) -> TokenEngine:
    if family not in _ENGINES:
        _ENGINES[family] = TokenEngine(
            cached_tokenizer(family),
            FAMILIES[family],
            append_roles=ROLES[family],
            tokenizer_name=tokenizer_path(family),
        )
    return _ENGINES[family]


def default_engine(family: str) -> TokenEngine:
    """The tokenizer's own (official) template, as `tito_model_family=default` runs it."""
    return TokenEngine(
        cached_tokenizer(family),
        FAMILIES["default"],
        append_roles=("tool", "user"),
        tokenizer_name=tokenizer_path(family),
    )


def M(**kw) -> ChatMessage:
    return ChatMessage.model_validate(kw)


def call(call_id: str, name: str, args: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def ids_of(engine: TokenEngine, *tokens: str) -> list[int]:
    ids = [engine.tokenizer.convert_tokens_to_ids(t) for t in tokens]
    assert all(isinstance(i, int) and i != engine.tokenizer.unk_token_id for i in ids), tokens
    return ids


# (appended messages, the assistant reply) per turn. Mistral tool-call ids are 9 alphanumerics (its template
# refuses others); gpt-oss cannot carry content and reasoning on one tool-call turn.
CONVERSATIONS: dict[str, list[tuple[list[ChatMessage], ChatMessage]]] = {
    "deepseek-r1": [
        (
            [M(role="system", content="You are a careful travel agent."), M(role="user", content="Paris and Oslo?")],
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
                M(role="tool", tool_call_id="call_1", content='{"temp_c": 21, "sky": "clear"}'),
                M(role="tool", tool_call_id="call_2", content='{"temp_c": -3, "sky": "snow"}'),
            ],
            M(role="assistant", content="Paris: 21 °C. Oslo: −3 °C.", reasoning_content="Summarise both."),
        ),
        (
            [M(role="user", content="Find me a café in Oslo.")],
            M(
                role="assistant",
                content="Searching.",
                reasoning_content="Search.",
                tool_calls=[call("call_3", "search", {"q": "café Oslo"})],
            ),
        ),
        (
            # A second tool-call turn right after tool results: the official template loses its framing here.
            [M(role="tool", tool_call_id="call_3", content="Fuglen, Tim Wendelboe")],
            M(
                role="assistant",
                content="",
                reasoning_content="Check the weather there too.",
                tool_calls=[call("call_4", "get_weather", {"city": "Oslo", "unit": "c"})],
            ),
        ),
        (
            [M(role="tool", tool_call_id="call_4", content='{"temp_c": -2}')],
            M(role="assistant", content="Try Fuglen; dress warmly.", reasoning_content="Two good picks."),
        ),
        (
            [M(role="user", content="Thanks! 谢谢")],
            M(role="assistant", content="You're welcome!", reasoning_content="Short reply."),
        ),
    ],
    "gpt-oss": [
        (
            [M(role="system", content="You are a careful travel agent."), M(role="user", content="Paris and Oslo?")],
            M(
                role="assistant",
                content="",
                reasoning_content="Weather and cafés: two calls.",
                tool_calls=[
                    call("call_1", "get_weather", {"city": "Paris"}),
                    call("call_2", "search", {"q": "café Paris"}),
                ],
            ),
        ),
        (
            # No `name` on the results (OpenAI wire format): harmony names the tool in each result's header.
            [
                M(role="tool", tool_call_id="call_1", content='{"temp_c": 21, "sky": "clear"}'),
                M(role="tool", tool_call_id="call_2", content="Café de Flore"),
            ],
            M(role="assistant", content="21 °C; try Café de Flore.", reasoning_content="Summarise both."),
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
            [M(role="tool", tool_call_id="call_3", content="Fuglen, Tim Wendelboe")],
            M(
                role="assistant",
                content="",
                reasoning_content="Check the weather there too.",
                tool_calls=[call("call_4", "get_weather", {"city": "Oslo", "unit": "c"})],
            ),
        ),
        (
            [M(role="tool", tool_call_id="call_4", content='{"temp_c": -2}')],
            M(role="assistant", content="Try Fuglen; dress warmly.", reasoning_content="Two good picks."),
        ),
        (
            [M(role="system", content="Answer in one line."), M(role="user", content="Thanks! 谢谢")],
            M(role="assistant", content="You're welcome!", reasoning_content="Short reply."),
        ),
    ],
    "mistral": [
        (
            [M(role="system", content="You are a careful travel agent."), M(role="user", content="Paris and Oslo?")],
            M(
                role="assistant",
                content="",
                tool_calls=[
                    call("abcDEF123", "get_weather", {"city": "Paris"}),
                    call("ghiJKL456", "get_weather", {"city": "Oslo"}),
                ],
            ),
        ),
        (
            [
                M(role="tool", tool_call_id="abcDEF123", content='{"temp_c": 21, "sky": "clear"}'),
                M(role="tool", tool_call_id="ghiJKL456", content='{"temp_c": -3, "sky": "snow"}'),
            ],
            M(role="assistant", content="Paris: 21 °C. Oslo: −3 °C."),
        ),
        (
            [M(role="user", content="Find me a café in Oslo.")],
            M(role="assistant", content="", tool_calls=[call("mnoPQR789", "search", {"q": "café Oslo"})]),
        ),
        (
            [M(role="tool", tool_call_id="mnoPQR789", content="Fuglen, Tim Wendelboe")],
            M(role="assistant", content="", tool_calls=[call("stuVWX012", "get_weather", {"city": "Oslo"})]),
        ),
        (
            [M(role="tool", tool_call_id="stuVWX012", content='{"temp_c": -2}')],
            M(role="assistant", content="Try Fuglen; dress warmly."),
        ),
        ([M(role="user", content="Thanks! 谢谢")], M(role="assistant", content="You're welcome!")),
    ],
}


def render_ids(engine: TokenEngine, messages: list[ChatMessage], kwargs: dict, *, generation: bool) -> list[int]:
    rendered = [template_message(m) for m in messages]
    return engine.encode(engine.render(rendered, TOOLS, add_generation_prompt=generation, kwargs=kwargs))


def sampled_completion(engine: TokenEngine, history: list[ChatMessage], reply: ChatMessage, kwargs: dict):
    """The ids a model emits for `reply`: the template's rendering of it, up to the stop id the model ends on."""
    before = engine.render([template_message(m) for m in history], TOOLS, add_generation_prompt=True, kwargs=kwargs)
    after = engine.render(
        [template_message(m) for m in history + [reply]], TOOLS, add_generation_prompt=False, kwargs=kwargs
    )
    assert after.startswith(before), "the assistant reply rewrote its own generation prompt"
    ids = engine.encode(after[len(before) :])
    last_stop = max(i for i, token in enumerate(ids) if token in engine.stop_ids)
    # Nothing the template writes after the stop id: these families need no boundary fixup.
    assert last_stop == len(ids) - 1, engine.tokenizer.decode(ids)
    return ids


def run_conversation(family: str, kwargs: dict):
    engine = engine_for(family)
    kwargs = engine.effective_kwargs(kwargs)
    history: list[ChatMessage] = []
    stored: list[int] | None = None
    completion: list[int] = []
    turns = []
    for appended, reply in CONVERSATIONS[family]:
        if stored is None:
            piece = engine.first_turn(history + appended, TOOLS, kwargs)
            prompt = piece.ids
        else:
            piece = engine.continuation(completion, appended, TOOLS, kwargs)
            prompt = stored + piece.ids
            assert prompt[: len(stored)] == stored, "the prompt must start with the previous prompt + completion"
        assert piece.segments[0].start == 0 and piece.segments[-1].end == len(piece.ids)
        history = history + appended
        turns.append((prompt, render_ids(engine, history, kwargs, generation=True), piece))
        completion = sampled_completion(engine, history, reply, kwargs)
        history.append(reply)
        stored = prompt + completion
    return engine, turns, stored, history


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("deepseek-r1", {}),
        ("gpt-oss", {}),
        ("gpt-oss", {"reasoning_effort": "high"}),
        ("gpt-oss", {"reasoning_effort": "low", "current_date": "2026-01-31"}),
        ("mistral", {}),
    ],
)
def test_incremental_equals_from_scratch(family: str, kwargs: dict) -> None:
    engine, turns, stored, history = run_conversation(family, kwargs)
    assert len(turns) == len(CONVERSATIONS[family])
    for turn, (prompt, scratch, _) in enumerate(turns):
        assert prompt == scratch, f"turn {turn}: incremental prompt differs from a from-scratch render"
    # The whole trajectory, last completion included, is the fixed template's render of the conversation.
    assert stored == render_ids(engine, history, engine.effective_kwargs(kwargs), generation=False)


def test_reasoning_of_every_turn_stays_in_the_prompt() -> None:
    for family in ("deepseek-r1", "gpt-oss"):
        engine, turns, _, _ = run_conversation(family, {})
        last_prompt = engine.tokenizer.decode(turns[-1][0])
        for _, reply in CONVERSATIONS[family][:-1]:
            assert reply.reasoning_content in last_prompt, (family, reply.reasoning_content)


def test_official_templates_drop_earlier_reasoning_where_ours_keep_it() -> None:
    """Why deepseek-r1 and gpt-oss ship their own templates."""
    history = [m for appended, reply in CONVERSATIONS["deepseek-r1"][1:2] for m in appended + [reply]]
    history = CONVERSATIONS["deepseek-r1"][0][0] + [CONVERSATIONS["deepseek-r1"][0][1]] + history
    history.append(M(role="user", content="More?"))
    rendered = [template_message(m) for m in history]
    for family in ("deepseek-r1", "gpt-oss"):
        engine = engine_for(family)
        if family == "deepseek-r1":  # the official template needs string arguments
            for message in rendered:
                for tool_call in message.get("tool_calls", []):
                    tool_call["function"]["arguments"] = json.dumps(tool_call["function"]["arguments"])
        stock = engine.tokenizer.apply_chat_template(
            rendered, tools=TOOLS, tokenize=False, add_generation_prompt=True, current_date=GPT_OSS_PINNED_DATE
        )
        ours = engine.render(rendered, TOOLS, add_generation_prompt=True, kwargs=engine.pinned_kwargs)
        assert "Summarise both." not in stock, family
        assert "Summarise both." in ours, family


def test_completions_end_on_the_stop_id_the_family_emits() -> None:
    """DeepSeek: <｜end▁of▁sentence｜>; gpt-oss: <|call|> after a tool call, <|return|> after a final answer;
    Mistral: </s>. The template writes nothing after it, so a continuation inserts nothing."""
    expected = {
        "deepseek-r1": ["<｜end▁of▁sentence｜>"] * 6,
        "gpt-oss": ["<|call|>", "<|return|>", "<|call|>", "<|call|>", "<|return|>", "<|return|>"],
        "mistral": ["</s>"] * 6,
    }
    for family, ends in expected.items():
        engine, turns, stored, _ = run_conversation(family, {})
        prompts = [prompt for prompt, _, _ in turns]
        for turn, end in enumerate(ends):
            if turn + 1 < len(turns):
                piece = turns[turn + 1][2]
                assert [s.source for s in piece.segments][0] != "boundary", (family, turn)
                last = prompts[turn + 1][len(prompts[turn + 1]) - len(piece.ids) - 1]
            else:
                last = stored[-1]
            assert last == ids_of(engine, end)[0], (family, turn)


def test_boundary_rules() -> None:
    deepseek, gpt_oss, mistral = (engine_for(f) for f in FAMILY_NAMES)
    (eos,) = ids_of(deepseek, "<｜end▁of▁sentence｜>")
    assert deepseek.boundary_ids([5, eos]) == []
    assert deepseek.boundary_ids([5, 6]) == [eos]  # cut off: closed, never glued onto the next message
    ret, call_, end = ids_of(gpt_oss, "<|return|>", "<|call|>", "<|end|>")
    assert gpt_oss.boundary_ids([5, ret]) == []  # <|return|> stays: it is the sampled token, not <|end|>
    assert gpt_oss.boundary_ids([5, call_]) == []
    assert gpt_oss.boundary_ids([5, end]) == []
    assert gpt_oss.boundary_ids([5, 6]) == [end]  # a cut-off harmony message is closed as a message, not a turn
    (eos,) = ids_of(mistral, "</s>")
    assert mistral.boundary_ids([5, eos]) == []
    assert mistral.boundary_ids([5, 6]) == [eos]
    assert deepseek.end_of_turn_tails == [[ids_of(deepseek, "<｜end▁of▁sentence｜>")[0]]]
    assert gpt_oss.end_of_turn_tails == [[ret], [call_], [end]]
    assert mistral.end_of_turn_tails == [[eos]]


def test_cut_off_completion_is_closed_before_the_next_message() -> None:
    engine = engine_for("gpt-oss")
    first = engine.first_turn([M(role="user", content="Count.")], None, engine.pinned_kwargs).ids
    cut = engine.encode("<|channel|>analysis<|message|>One, two")
    piece = engine.continuation(cut, [M(role="user", content="Go on.")], None, engine.pinned_kwargs)
    assert [s.source for s in piece.segments] == ["boundary", "messages", "generation_prompt"]
    assert engine.tokenizer.decode(first + cut + piece.ids).endswith(
        "One, two<|end|><|start|>user<|message|>Go on.<|end|><|start|>assistant"
    )


@pytest.mark.parametrize("family", ["deepseek-r1", "mistral"])
def test_system_appends_are_refused_at_startup(family: str) -> None:
    with pytest.raises(ValueError, match=f"family {family} cannot append system messages.*tito_append_roles=tool,user"):
        TokenEngine(cached_tokenizer(family), FAMILIES[family], tokenizer_name=tokenizer_path(family))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_official_template_is_refused_with_the_family_to_use(family: str) -> None:
    """`default` runs the tokenizer's own template only if it is append-only; none of these three is."""
    engine = default_engine(family)
    assert suggest_family(engine.template) == family
    with pytest.raises(ValueError, match=f"is not append-only: .*use tito_model_family={family}$"):
        engine.check_append_only()
    engine_for(family).check_append_only()


def test_probe_names_what_the_official_templates_rewrite() -> None:
    problems = {family: " | ".join(default_engine(family).append_only_problems()) for family in FAMILY_NAMES}
    assert "TypeError" in problems["deepseek-r1"]  # object arguments: it concatenates them as strings
    # gpt-oss rewrites a final answer (analysis dropped, <|return|> to <|end|>) and names a result's tool from
    # history the wire format does not carry.
    assert "after a final answer rewrites earlier text" in problems["gpt-oss"]
    assert "<|start|>functions.tool to=assistant" in problems["gpt-oss"]
    assert "AVAILABLE_TOOLS] [" in problems["mistral"]  # the tools block moves to the last user message


def test_reasoning_effort_shapes_only_the_first_turn() -> None:
    """gpt-oss writes reasoning_effort into the system message, which a continuation never re-renders."""
    engine = engine_for("gpt-oss")
    medium = engine.first_turn([M(role="user", content="Hi")], None, engine.effective_kwargs({})).ids
    hi = [M(role="user", content="Hi")]
    high = engine.first_turn(hi, None, engine.effective_kwargs({"reasoning_effort": "high"}))
    assert "Reasoning: high" in engine.tokenizer.decode(high.ids) and high.ids != medium
    completion = engine.encode("<|channel|>final<|message|>Hello!<|return|>")
    appended = [M(role="user", content="Again?")]
    follow = [
        engine.continuation(completion, appended, None, engine.effective_kwargs(kw)).ids
        for kw in ({}, {"reasoning_effort": "high"})
    ]
    assert follow[0] == follow[1]


def test_pinned_date_and_its_override() -> None:
    engine = engine_for("gpt-oss")
    assert engine.pinned_kwargs == {"current_date": GPT_OSS_PINNED_DATE}
    text = engine.tokenizer.decode(engine.first_turn([M(role="user", content="Hi")], None, engine.pinned_kwargs).ids)
    assert f"Current date: {GPT_OSS_PINNED_DATE}\n" in text
    hi = [M(role="user", content="Hi")]
    other = engine.first_turn(hi, None, engine.effective_kwargs({"current_date": "2030-01-02"}))
    assert "Current date: 2030-01-02\n" in engine.tokenizer.decode(other.ids)


@pytest.mark.parametrize(
    ("family", "stored", "requested", "changed"),
    [
        ("gpt-oss", {"reasoning_effort": "low"}, {"reasoning_effort": "high"}, True),
        ("gpt-oss", {}, {"current_date": "2026-01-01"}, True),
        ("gpt-oss", {}, {"unrelated": 1}, False),
        ("deepseek-r1", {}, {"unrelated": 1}, False),
        ("mistral", {}, {"unrelated": 1}, False),
    ],
)
def test_kwargs_that_rerender_the_history_are_told_apart(family, stored, requested, changed) -> None:
    engine = engine_for(family)
    pinned = engine.pinned_kwargs
    assert engine.history_changed({**pinned, **stored}, {**pinned, **requested}, TOOLS) is changed


async def test_a_changed_reasoning_effort_is_a_fresh_render_not_a_continuation() -> None:
    """gpt-oss keeps `reasoning_effort` in the system message, which a continuation never re-renders: the turn
    that changes it is served from scratch (a new root), so the model is told; unchanged kwargs continue."""
    from tito_addon.backends.backend_protocol import BackendResult
    from tito_addon.backends.sglang_backend import SglangBackend
    from tito_addon.backends.upstream_client import UpstreamClient
    from tito_addon.records.records_port import NullRecords
    from tito_addon.sessions.memory_sessions import MemorySessions
    from tito_addon.turns.turn_service import TurnService

    engine = engine_for("gpt-oss")
    service = TurnService(engine, SglangBackend(UpstreamClient()), MemorySessions(), NullRecords())
    headers = {"x-session-id": "effort"}
    first = [{"role": "user", "content": "Hi"}]

    def body(messages, effort):
        return json.dumps({"messages": messages, "chat_template_kwargs": {"reasoning_effort": effort}}).encode()

    prepared = await service.prepare("/v1/chat/completions", headers, body(first, "low"))
    completion = engine.encode("<|channel|>final<|message|>Hello!<|return|>")
    message = {"role": "assistant", "content": "Hello!"}
    run = await service.start(prepared, headers, "")
    await run.finish(BackendResult(completion, [-0.1] * len(completion), message, "stop", {}))
    await run.release()
    follow = [*first, message, {"role": "user", "content": "More?"}]
    same = await service.prepare("/v1/chat/completions", headers, body(follow, "low"))
    assert same.parent is not None and same.prompt.ids[: len(prepared.prompt.ids) + len(completion)] == (
        prepared.prompt.ids + completion
    )
    changed = await service.prepare("/v1/chat/completions", headers, body(follow, "high"))
    assert changed.parent is None
    assert "Reasoning: high" in engine.tokenizer.decode(changed.prompt.ids)
    assert changed.prompt.ids == engine.first_turn([ChatMessage(**m) for m in follow], None, changed.kwargs).ids


def test_gpt_oss_stops_without_a_generation_config() -> None:
    """A hub name (no local generation_config.json) still stops on <|call|>, so a tool call is never closed twice."""
    engine = TokenEngine(cached_tokenizer("gpt-oss"), FAMILIES["gpt-oss"], tokenizer_name="openai/gpt-oss-20b")
    ret, call_ = ids_of(engine, "<|return|>", "<|call|>")
    assert {ret, call_} <= set(engine.stop_ids) and engine.boundary_ids([5, call_]) == []


def test_a_template_refusing_the_request_is_the_clients_400() -> None:
    engine = engine_for("mistral")
    with pytest.raises(TemplateRefusal, match="Tool call IDs should be alphanumeric strings with length 9") as raised:
        engine.continuation([2], [M(role="tool", tool_call_id="call_1", content="x")], None, {})
    assert raised.value.status == 400 and isinstance(raised.value, TokenizationError)


# -- goldens and drift cases -----------------------------------------------------------------------------------


def golden(family: str, name: str = "3turn_tool_call") -> dict:
    for line in (SHARED / "tokenizers" / "render_examples.jsonl").read_text("utf-8").splitlines():
        example = json.loads(line)
        if example["family"] == family and example["name"] == name:
            return example
    raise LookupError(family)


def test_deepseek_golden_render() -> None:
    """On a conversation the official template renders right, ours renders the same ids."""
    example = golden("deepseek-r1")
    engine = engine_for("deepseek-r1")
    messages = [M(**m) for m in example["messages"]]
    assert engine.first_turn(messages, example["tools"], {}).ids == example["ids"]


@pytest.mark.parametrize("name", ["3turn_tool_call", "3turn_tool_call_reasoning_high"])
def test_gpt_oss_golden_render(name: str) -> None:
    """Ours is the official render (date pinned to the golden's) with harmony's own spelling of tool traffic
    (<|constrain|>json, the result verbatim) and the final answer ending with the <|return|> the model
    stopped on, where the official template writes <|end|>."""
    example = golden("gpt-oss", name)
    engine = engine_for("gpt-oss")
    messages = [M(**m) for m in example["messages"]]
    ours = engine.first_turn(messages, example["tools"], engine.effective_kwargs(example["chat_template_kwargs"])).ids
    harmony = (
        example["text"]
        .replace("<|channel|>commentary json<|message|>", "<|channel|>commentary <|constrain|>json<|message|>")
        .replace('"{\\"temp_c\\": 21, \\"sky\\": \\"clear\\"}"', '{"temp_c": 21, "sky": "clear"}')
        .replace("clear in Paris.<|end|>", "clear in Paris.<|return|>")
    )
    assert harmony.count("<|constrain|>") == 1 and harmony.count("<|return|>") == 1 and '\\"' not in harmony
    assert ours == engine.encode(harmony)
    assert ours != example["ids"]


def test_mistral_golden_render() -> None:
    """A first turn renders as the official template does; later the system message and tools stay at the first
    user message, where the official template moves them to the last one."""
    example = golden("mistral")
    engine = engine_for("mistral")
    messages = [M(**m) for m in example["messages"]]
    tokenizer = engine.tokenizer
    first_turn = [template_message(m) for m in messages[:2]]
    official = tokenizer.apply_chat_template(first_turn, tools=example["tools"], tokenize=False)
    assert engine.first_turn(messages[:2], example["tools"], {}).ids == engine.encode(official)
    text = example["text"]
    tools_block = text[text.index("[AVAILABLE_TOOLS]") : text.index("[/AVAILABLE_TOOLS]") + len("[/AVAILABLE_TOOLS]")]
    moved = text.replace(tools_block, "").replace("You are a concise assistant.\n\n", "")
    moved = moved.replace("<s>[INST] ", "<s>" + tools_block + "[INST] You are a concise assistant.\n\n", 1)
    ours = engine.first_turn(messages, example["tools"], {}).ids
    assert ours != example["ids"] and ours == engine.encode(moved)


def drift_cases(family: str) -> list[dict]:
    path = SHARED / "drift_cases" / f"{family}.jsonl"
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_drift_cases_survive_into_the_next_prompt(family: str) -> None:
    """Each case's ids (which re-tokenizing or re-rendering changes) reach the next prompt unchanged, whether or
    not the model closed its turn."""
    engine = engine_for(family)
    kwargs = engine.pinned_kwargs
    closers = {tail[-1] for tail in engine.end_of_turn_tails}
    cases = drift_cases(family)
    assert len(cases) >= 15
    first = engine.first_turn([M(role="user", content="Go on.")], None, kwargs).ids
    for case in cases:
        ids = case["ids"]
        assert ids != case["canonical_ids"]
        for completion in (ids, ids if ids[-1] in closers else ids + [engine.stop_ids[-1]]):
            follow = engine.continuation(completion, [M(role="user", content="Next?")], None, kwargs)
            prompt = first + completion + follow.ids
            assert prompt[len(first) : len(first) + len(ids)] == ids, case["kind"]
            assert follow.ids[: len(engine.boundary_ids(completion))] == engine.boundary_ids(completion)
        if "messages" not in case:  # ...whereas the re-tokenizing pipeline would have changed them
            # (the other-tokenizer kinds hold ids this tokenizer does not produce even by re-encoding)
            other_tokenizer = case["kind"] in ("hf_vs_mistral_common_text", "library_version_drift")
            assert engine.encode(engine.tokenizer.decode(ids)) != ids or other_tokenizer, case["kind"]


def case_messages(case: dict) -> list[ChatMessage]:
    messages = []
    for message in case["messages"]:
        message = dict(message)
        if "thinking" in message:  # harmony's name for the analysis text
            message["reasoning_content"] = message.pop("thinking")
        messages.append(M(**message))
    return messages


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_template_drift_cases_are_what_the_engine_builds(family: str) -> None:
    """Template cases hold the ids a policy saw over a conversation (prompt, sampled completion, next turn). The
    engine builds exactly those ids: its first turn is their prefix, and the sampled completion followed by
    its continuation is the rest, wherever the case's kwargs are the ones the engine renders with."""
    engine = engine_for(family)
    checked = 0
    for case in drift_cases(family):
        if "messages" not in case or case["kind"] == "template_system_merge":
            continue
        messages = case_messages(case)
        kwargs = engine.effective_kwargs({"reasoning_effort": "high"} if "reasoning_effort" in case["kind"] else {})
        tools = [TOOLS[0]] if any(m.tool_calls for m in messages) else None
        first_assistant = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
        ids = case["ids"]
        prompt = engine.first_turn(messages[:first_assistant], tools, kwargs).ids
        assert ids[: len(prompt)] == prompt, case["kind"]
        rest, appended = ids[len(prompt) :], messages[first_assistant + 1 :]
        if first_assistant == len(messages):
            assert rest == [], case["kind"]
        elif not appended:
            assert rest[-1] in engine.stop_ids, case["kind"]
        else:
            splits = [
                i + 1
                for i, token in enumerate(rest)
                if token in engine.stop_ids
                and rest[: i + 1] + engine.continuation(rest[: i + 1], appended, tools, kwargs).ids == rest
            ]
            assert len(splits) == 1, case["kind"]
        checked += 1
    assert checked == {"deepseek-r1": 2, "gpt-oss": 5, "mistral": 1}[family]


def test_multiturn_drift_cases_rerender_exactly_with_our_templates() -> None:
    """Where the official template drops the sampled reasoning (and gpt-oss rewrites <|return|>), the fixed
    template re-renders the conversation to exactly the ids the policy saw."""
    for family in ("deepseek-r1", "gpt-oss"):
        engine = engine_for(family)
        (case,) = [c for c in drift_cases(family) if c["kind"] == "template_rerender_multiturn"]
        rendered = [template_message(m) for m in case_messages(case)]
        text = engine.render(rendered, None, add_generation_prompt=True, kwargs=engine.pinned_kwargs)
        assert engine.encode(text) == case["ids"], family
        assert engine.encode(text) != case["canonical_ids"], family


def test_deepseek_system_merge_case() -> None:
    """Several leading system messages are joined as the official template joins them."""
    engine = engine_for("deepseek-r1")
    (case,) = [c for c in drift_cases("deepseek-r1") if c["kind"] == "template_system_merge"]
    assert engine.first_turn(case_messages(case), None, {}).ids == case["ids"]
