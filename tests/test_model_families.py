"""deepseek-r1, gpt-oss (harmony) and mistral on their real tokenizers: every prompt extends the previous prompt +
completion ids exactly, equals a from-scratch render of the family's (fixed) template, and keeps every drift
case of the family; boundary rules, reasoning handling and what each family refuses are pinned here."""

from __future__ import annotations

import json

import pytest
from conftest import SHARED, TOOLS, cached_tokenizer, tokenizer_path

from tito_addon.message_keys import template_message
from tito_addon.model_families import FAMILIES, GPT_OSS_PINNED_DATE, suggest_family
from tito_addon.tito_errors import TokenizationError
from tito_addon.token_engine import TokenEngine
from tito_addon.wire_models import ChatMessage

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
