"""The appended messages' text read off the template's pieces equals the Jinja render, on every family, for the golden
and drift conversations, the drift cases' own texts, adversarial and generated contents; and it is really used."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.basics import SHARED, TOOLS, cached_engine, cached_tokenizer

from tito_addon.canonical_chat import ChatMessage
from tito_addon.engine.model_families import FAMILIES
from tito_addon.engine.role_pieces import CONTENT_PROBES, RolePieces
from tito_addon.engine.token_engine import TokenEngine
from tito_addon.tito_errors import TemplateRefusal

FAMILY_NAMES = ["qwen3", "qwen2.5", "deepseek-r1", "gpt-oss", "mistral"]
# Mistral wants 9-character alphanumeric ids; the others take any.
CALL_IDS = ["callA0001", "callB0002", "callC0003"]


def engine_for(family: str) -> TokenEngine:
    return cached_engine(family, roles=("tool", "user"))


def M(**kw) -> ChatMessage:
    return ChatMessage.model_validate(kw)


def same(engine: TokenEngine, appended, tools, kwargs, names=()) -> bool:
    """Pieces and Jinja agree (or both refuse alike); returns whether the pieces were used."""
    hits = engine.pieces.hits
    try:
        jinja = engine._synthetic_suffix_jinja(appended, tools, kwargs, names)
    except Exception as exc:
        with pytest.raises(type(exc)):
            engine._synthetic_suffix(appended, tools, kwargs, names)
        return False
    assert engine._synthetic_suffix(appended, tools, kwargs, names) == jinja
    return engine.pieces.hits > hits


def called_names(engine: TokenEngine, assistant: ChatMessage) -> list[str]:
    if not engine.family.tool_call_name_pattern or not assistant.tool_calls:
        return []
    return [call.function.name for call in assistant.tool_calls]


def continuations(messages: list[ChatMessage]):
    """(the assistant turn, the messages appended after it) for each assistant turn followed by messages."""
    for index, message in enumerate(messages):
        if message.role != "assistant":
            continue
        appended = []
        for later in messages[index + 1 :]:
            if later.role == "assistant":
                break
            appended.append(later)
        if appended:
            yield message, appended


def conversations(family: str):
    """The golden conversations and the drift cases' conversations of a family, with tools and kwargs."""
    engine = engine_for(family)
    for line in (SHARED / "tokenizers" / "render_examples.jsonl").read_text("utf-8").splitlines():
        example = json.loads(line)
        if example["family"] == family:
            kwargs = engine.effective_kwargs(example.get("chat_template_kwargs") or {})
            yield [M(**m) for m in example["messages"]], example["tools"], kwargs
    for line in (SHARED / "drift_cases" / f"{family}.jsonl").read_text("utf-8").splitlines():
        case = json.loads(line) if line.strip() else {}
        if "messages" in case:
            messages = []
            for message in case["messages"]:
                message = dict(message)
                if "thinking" in message:
                    message["reasoning_content"] = message.pop("thinking")
                messages.append(M(**message))
            yield messages, [TOOLS[0]], engine.pinned_kwargs


def drift_texts(family: str) -> list[str]:
    lines = (SHARED / "drift_cases" / f"{family}.jsonl").read_text("utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_golden_and_drift_conversations(family: str) -> None:
    """Every continuation of the golden and drift conversations: the same text, and the same ids end to end."""
    engine = engine_for(family)
    checked = hits = 0
    for messages, tools, kwargs in conversations(family):
        for assistant, appended in continuations(messages):
            if any(m.role not in engine.append_roles for m in appended):
                continue
            names = called_names(engine, assistant)
            for tools_ in (tools, None):
                hits += same(engine, appended, tools_, kwargs, names)
                checked += 1
    assert checked >= 4
    assert hits == checked  # plain tool results and user messages: all by pieces


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_drift_texts_as_appended_contents(family: str) -> None:
    """The drift cases' texts (markers spelled in ordinary tokens, split UTF-8, U+FFFD, NFD, [INST]...) as tool
    results and user messages: pieces where no marker is in them, Jinja where one is; the same text either way."""
    engine = engine_for(family)
    texts = drift_texts(family) + list(CONTENT_PROBES)
    hits = total = 0
    for text in texts:
        for appended in (
            [M(role="tool", tool_call_id=CALL_IDS[0], content=text)],
            [M(role="user", content=text)],
            [
                M(role="tool", tool_call_id=CALL_IDS[0], content=text),
                M(role="tool", tool_call_id=CALL_IDS[1], content="ok"),
                M(role="user", content=text[::-1]),
            ],
        ):
            names = ["get_weather", "search"] if engine.family.tool_call_name_pattern else []
            for tools in (TOOLS, None):
                hits += same(engine, appended, tools, engine.pinned_kwargs, names)
                total += 1
    print(f"{family}: {hits}/{total} by pieces")
    assert hits >= total // 2


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_pieces_are_taken_for_plain_messages_and_not_for_markers(family: str) -> None:
    engine = engine_for(family)
    tool = M(role="tool", tool_call_id=CALL_IDS[2], content='{"temp_c": 21, "sky": "clear"}\n')
    user = M(role="user", content="  And in Oslo? <b>bold</b> {{ x }}\n")
    names = ["get_weather"] if engine.family.tool_call_name_pattern else []
    # Mistral refuses a user message right after tool results (roles must alternate): two results instead.
    second = tool.model_copy(update={"tool_call_id": CALL_IDS[1]}) if family == "mistral" else user
    for appended in ([tool], [user], [tool, second]):
        hits = engine.pieces.hits
        assert same(engine, appended, TOOLS, engine.pinned_kwargs, names)
        assert same(engine, appended, TOOLS, engine.pinned_kwargs, names)
        assert engine.pieces.hits == hits + 2
    for marker in (engine.pieces.markers[0], engine.pieces.markers[-1], engine.pieces.nonce):
        for appended in ([tool.model_copy(update={"content": f"x{marker}y"})], [user, M(role="user", content=marker)]):
            fallbacks = engine.pieces.fallbacks
            assert not same(engine, appended, TOOLS, engine.pinned_kwargs, names)
            assert engine.pieces.fallbacks == fallbacks + 1


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_continuation_ids_are_the_same_without_pieces(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(family)
    completion = engine.encode("Let me check.") + engine.end_of_turn_ids
    second = (
        M(role="tool", tool_call_id=CALL_IDS[1], content="ok") if family == "mistral" else M(role="user", content="Go")
    )
    appended = [M(role="tool", tool_call_id=CALL_IDS[0], content="result " * 300), second]
    fast = engine.continuation(completion, appended, TOOLS, engine.pinned_kwargs)
    monkeypatch.setattr(engine.pieces, "enabled", False)
    assert engine.continuation(completion, appended, TOOLS, engine.pinned_kwargs) == fast


def test_no_appended_messages() -> None:
    for family in FAMILY_NAMES:
        engine = engine_for(family)
        assert same(engine, [], TOOLS, engine.pinned_kwargs), family


def test_ids_are_holes_or_keyed_by_class_and_length() -> None:
    """gpt-oss matches a result to its call by id (equal ids name the same call); Mistral writes the id and wants
    nine characters. Equal, distinct and odd-length ids render as Jinja does, refusals included."""
    for family in ("gpt-oss", "mistral", "qwen3"):
        engine = engine_for(family)
        names = ["get_weather", "search"] if family == "gpt-oss" else []
        for ids in (
            ["callA0001", "callA0001"],
            ["callA0001", "callB0002"],
            ["call_1", "call_2"],
            ["c1", "c2"],
            [None, None],
            [None, "call_0"],  # the synthetic base's own name for the unnamed call: left to Jinja
            [None, "call_1"],
        ):
            appended = [M(role="tool", tool_call_id=i, content=f"r{n}") for n, i in enumerate(ids)]
            same(engine, appended, TOOLS, engine.pinned_kwargs, names)
    engine = engine_for("mistral")
    with pytest.raises(TemplateRefusal):
        engine._synthetic_suffix([M(role="tool", tool_call_id="call_1", content="x")], None, {})
    hits, odd = engine.pieces.hits, '"\\{}<>[]x'
    text, _ = engine._synthetic_suffix([M(role="tool", tool_call_id=odd, content="x")], None, {})
    assert len(odd) == 9 and f'"call_id": "{odd}"' in text
    assert engine.pieces.hits == hits + 1


def test_a_shape_the_probes_disprove_is_never_used() -> None:
    """A renderer that trims, escapes, branches on length or puts content in the generation prompt: the probes
    catch it at shape creation and every turn of that shape goes to the renderer."""
    tokenizer = cached_tokenizer("qwen3")
    renderers = {
        "trims": lambda ms: ("".join(f"<{m.role}>{m.text().strip()}" for m in ms), "GEN"),
        "escapes": lambda ms: ("".join(f"<{m.role}>{json.dumps(m.text())}" for m in ms), "GEN"),
        "branches": lambda ms: ("".join(f"<{m.role}>{m.text() if len(m.text()) > 1 else '-'}" for m in ms), "GEN"),
        "generation": lambda ms: ("".join(f"<{m.role}>" for m in ms), ms[-1].text()),
        "verbatim": lambda ms: ("".join(f"<{m.role}>{m.text()}|{m.tool_call_id}" for m in ms), "GEN"),
    }
    appended = [M(role="tool", tool_call_id="callA0001", content="result"), M(role="user", content="next")]
    for name, renderer in renderers.items():
        pieces = RolePieces(
            lambda ms, tools, kwargs, names, r=renderer: r(ms), family="qwen3", template="", tokenizer=tokenizer
        )
        for _ in range(2):
            got = pieces.suffix(appended, None, {})
            assert (got is not None) == (name == "verbatim"), name
            if got is not None:
                assert got == renderer(appended)
    unvetted = RolePieces(lambda *a: ("", ""), family="default", template="", tokenizer=tokenizer)
    assert unvetted.suffix(appended, None, {}) is None and unvetted.hits == 0


MARKERS = [
    "<tool_response>", "</tool_response>", "</think>", "<think>", "<|im_end|>", "[INST]", "[/INST]", "</s>", "<|end|>",
    "<|channel|>final<|message|>", "<｜tool▁output▁end｜>", "<｜User｜>", "{{", "}}", "{%", '"', "\\",
]  # fmt: skip
content_text = st.lists(
    st.one_of(st.text(max_size=12), st.sampled_from(MARKERS), st.sampled_from([" ", "\n", "\t", "\r\n", "\u00a0"])),
    max_size=6,
).map("".join)


@pytest.mark.parametrize("family", FAMILY_NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_contents(family: str, data: st.DataObject) -> None:
    engine = engine_for(family)
    roles = data.draw(st.lists(st.sampled_from(["tool", "user"]), min_size=1, max_size=3))
    appended = []
    for role in roles:
        content = data.draw(content_text)
        if role == "tool":
            call_id = data.draw(st.sampled_from(CALL_IDS + ["toolu_01XyZ", "call_" + "9" * 24]))
            appended.append(M(role="tool", tool_call_id=call_id, content=content))
        else:
            appended.append(M(role="user", content=[{"type": "text", "text": content}, {"type": "text", "text": "p"}]))
    kwargs = dict(engine.pinned_kwargs)
    if family == "qwen3":
        kwargs["enable_thinking"] = data.draw(st.booleans())
    names = data.draw(st.lists(st.sampled_from(["get_weather", "search"]), max_size=2)) if family == "gpt-oss" else []
    same(engine, appended, data.draw(st.sampled_from([TOOLS, None])), kwargs, names)


def test_families_have_pieces() -> None:
    for family in FAMILY_NAMES:
        assert engine_for(family).pieces.enabled, family
    assert FAMILIES["default"].template_file is None
