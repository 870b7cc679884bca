"""The Gemini API through a real mitmdump, with the google-genai SDK as the agent: token-exact function-calling loops
(the agent's own and the SDK's automatic one), streams that accumulate to what a whole reply holds, countTokens from
our own render, thought signatures that bring back the exact reasoning after the thought parts are dropped, any model
name in the path, and errors in Google's shape."""

from __future__ import annotations

import base64
import json

import pytest
from google import genai
from google.genai import errors, types
from support.basics import tokenizer_path
from support.gemini_agent import THOUGHTS, TOOLS, WEATHER, results
from support.proxy_harness import post
from support.token_exact import assert_token_exact, recorded

from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def replica():
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), preferred_tools={"get_weather": {"city": "Paris"}})
    with ReplicaThread(config) as running:
        yield running


def client(proxy, version: str = "v1beta") -> genai.Client:
    retry = types.HttpRetryOptions(attempts=1)
    options = types.HttpOptions(base_url=proxy.url, api_version=version, retry_options=retry)
    return genai.Client(api_key="gemini-client-key", http_options=options)


def config(**extra) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(system_instruction="Be brief.", tools=TOOLS, thinking_config=THOUGHTS, **extra)


def test_function_calling_loop_and_a_second_user_turn_are_token_exact(proxy, replica) -> None:
    api = client(proxy)
    contents: list[types.Content] = [types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])]
    replies = []
    for _ in range(2):
        reply = api.models.generate_content(model="qwen3", contents=contents, config=config())
        replies.append(reply)
        content = reply.candidates[0].content
        calls = [p.function_call for p in content.parts if p.function_call]
        assert calls and all(c.name == "get_weather" and c.args == {"city": "Paris"} for c in calls)
        assert all(c.id.startswith("call_") for c in calls)
        assert reply.candidates[0].finish_reason == types.FinishReason.STOP
        # The first part that is not a thought carries the signature; thought parts come first.
        kinds = ["thought" if p.thought else "signed" if p.thought_signature else "part" for p in content.parts]
        assert kinds[0] == "thought" and kinds[1] == "signed" and "signed" not in kinds[2:]
        contents += [content, results(content)]
        answer = api.models.generate_content(model="qwen3", contents=contents, config=config())
        replies.append(answer)
        assert answer.text and not any(p.function_call for p in answer.candidates[0].content.parts)
        contents += [answer.candidates[0].content, types.Content(role="user", parts=[types.Part(text="And Rome?")])]
    turns = assert_token_exact(proxy.record_dir, replica)
    assert len(turns) == 4 and len({t.session_id for t in turns}) == 1
    assert [t.parent_turn_id for t in turns] == [None, 0, 1, 2]
    assert all(t.api == "gemini" for t in turns)
    assert [t.reply_id for t in turns] == [r.response_id for r in replies]
    for reply, turn in zip(replies, turns, strict=True):
        usage = reply.usage_metadata
        assert usage.prompt_token_count == turn.prompt_len
        assert usage.candidates_token_count + (usage.thoughts_token_count or 0) == len(turn.completion_ids)
        assert usage.total_token_count == turn.prompt_len + len(turn.completion_ids)
        assert reply.model_version == "qwen3"
    # Thinking tokens are counted up to and with </think>.
    first = turns[0].completion_ids
    assert replies[0].usage_metadata.thoughts_token_count == first.index(151668) + 1
    # The appended contents are kept in Gemini's own form as well as the canonical one.
    assert turns[1].appended_items[0]["parts"][0]["functionResponse"]["name"] == "get_weather"


def test_dropped_thought_parts_come_back_from_the_signature(proxy, replica) -> None:
    """Gemini CLI sends the history back without thought parts: the signature alone names the exact reasoning, so
    the next prompt still extends the turn's exact ids; the placeholder Gemini CLI puts on a call, a signature moved
    to another part, or a forged one are each served (200), a forged one noted."""
    api = client(proxy)
    user = types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])
    reply = api.models.generate_content(model="qwen3", contents=[user], config=config())
    content = reply.candidates[0].content
    assert content.parts[0].thought and content.parts[0].text
    kept = [p for p in content.parts if not p.thought]
    stripped = types.Content(role="model", parts=kept)
    nxt = api.models.generate_content(model="qwen3", contents=[user, stripped, results(content)], config=config())
    assert nxt.candidates[0].content.parts
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0] and not turns[1].left_out
    # The sealed reasoning is what the model produced, byte for byte.
    assert turns[0].assistant_message["reasoning_content"] == content.parts[0].text

    raw = json.loads(stripped.model_dump_json(exclude_none=True, by_alias=True))
    signature = raw["parts"][0].pop("thoughtSignature")
    moved = {"role": "model", "parts": [*raw["parts"][:-1], {**raw["parts"][-1], "thoughtSignature": signature}]}
    placeholder = {"role": "model", "parts": [{**p, "thoughtSignature": "skip_thought_signature_validator"}
                                              for p in raw["parts"]]}  # fmt: skip
    forged_value = base64.b64encode(b"tito1.forged.signature.value").decode()
    forged = {"role": "model", "parts": [{**p, "thoughtSignature": forged_value} for p in raw["parts"]]}
    tool = json.loads(results(content).model_dump_json(exclude_none=True, by_alias=True))
    first = json.loads(user.model_dump_json(exclude_none=True, by_alias=True))
    for history, note in ((moved, False), (placeholder, False), (forged, True)):
        declaration = WEATHER.model_dump(mode="json", exclude_none=True, by_alias=True)
        body = {"contents": [first, history, tool], "systemInstruction": {"parts": [{"text": "Be brief."}]},
                "generationConfig": {"thinkingConfig": {"includeThoughts": True}},
                "tools": [{"functionDeclarations": [declaration]}]}  # fmt: skip
        answer = post(f"{proxy.url}/v1beta/models/qwen3:generateContent", json=body)
        assert answer.status_code == 200, answer.text()
        last = recorded(proxy.record_dir)[-1]
        assert last.parent_turn_id == 0  # the echoed turn is found by its visible parts and the ids are the stored ones
        assert any("thoughtSignature that is not ours" in n for n in last.left_out or []) is note
    assert_token_exact(proxy.record_dir, replica)


def test_calls_and_responses_echoed_without_ids_keep_the_turns_ids(proxy, replica) -> None:
    """pi's Gemini history: no thought parts, the signature where it came (on a call, or on the text before the
    calls), and no ids on the function calls nor on their responses. The calls get back the ids the proxy gave them
    (made from the reply id the signature names), so each request extends the turn before; each response takes the
    id of the call at its place (the replica's third turn makes two calls)."""
    declaration = WEATHER.model_dump(mode="json", exclude_none=True, by_alias=True)
    base = {"systemInstruction": {"parts": [{"text": "Be brief."}]}, "tools": [{"functionDeclarations": [declaration]}]}
    url = f"{proxy.url}/v1beta/models/qwen3:streamGenerateContent?alt=sse"
    contents: list[dict] = [{"role": "user", "parts": [{"text": "Weather in Paris?"}]}]
    given: list[list[str]] = []
    for _ in range(4):
        reply = post(url, json={**base, "contents": contents})
        assert reply.status_code == 200, reply.text
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
        parts = [part for chunk in chunks for part in chunk["candidates"][0]["content"]["parts"]]
        calls = [part["functionCall"] for part in parts if "functionCall" in part]
        given.append([call["id"] for call in calls])
        model = [
            {**part, "functionCall": {"name": part["functionCall"]["name"], "args": part["functionCall"]["args"]}}
            if "functionCall" in part else part
            for part in parts
            if not part.get("thought")
        ]  # fmt: skip
        outputs = [{"functionResponse": {"name": c["name"], "response": {"output": f"{c['id'][-4:]}: 21 C"}}}
                   for c in calls]  # fmt: skip
        contents += [{"role": "model", "parts": model}, {"role": "user", "parts": outputs or [{"text": "And Rome?"}]}]
    assert [len(ids) for ids in given] == [1, 0, 2, 0]
    assert "thoughtSignature" in contents[1]["parts"][0] and "text" in contents[5]["parts"][0]
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 1, 2]
    for turn, ids in zip(turns, given, strict=True):
        assert [c["id"] for c in turn.assistant_message.get("tool_calls") or []] == ids
    results = [(m["tool_call_id"], m["content"]) for t in turns for m in t.appended_messages if m["role"] == "tool"]
    assert results == [(i, f"{i[-4:]}: 21 C") for ids in given for i in ids]


def test_automatic_function_calling_of_the_sdk_is_token_exact(proxy, replica) -> None:
    """The SDK's own loop: a Python function as the tool, called and answered by the SDK itself."""
    seen: list[str] = []

    def get_weather(city: str) -> str:
        """Current weather for a city."""
        seen.append(city)
        return f"{city}: 21 C, sunny"

    api = client(proxy)  # held: a client the garbage collector takes closes its connections
    chat = api.chats.create(model="qwen3", config=types.GenerateContentConfig(tools=[get_weather]))
    reply = chat.send_message("Weather in Paris?")
    assert seen and set(seen) == {"Paris"} and reply.text
    again = chat.send_message("And tomorrow?")
    assert again.text
    turns = assert_token_exact(proxy.record_dir, replica)
    assert len({t.session_id for t in turns}) == 1 and turns[0].parent_turn_id is None
    assert all(t.parent_turn_id == t.turn_id - 1 for t in turns[1:])


def test_stream_accumulates_to_what_the_whole_reply_holds(proxy, replica) -> None:
    api = client(proxy)
    contents = [types.Content(role="user", parts=[types.Part(text="Weather in Oslo?")])]
    whole = api.models.generate_content(model="qwen3", contents=contents, config=config())
    chunks = list(api.models.generate_content_stream(model="qwen3", contents=contents, config=config()))
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1])
    streamed = [p for c in chunks for p in c.candidates[0].content.parts or []]
    parts = whole.candidates[0].content.parts
    assert "".join(p.text for p in streamed if p.thought) == "".join(p.text for p in parts if p.thought)
    assert [p.function_call.args for p in streamed if p.function_call] == [
        p.function_call.args for p in parts if p.function_call
    ]
    assert sum(bool(p.thought_signature) for p in streamed) == 1
    usage, recorded_turn = chunks[-1].usage_metadata, recorded(proxy.record_dir)[-1]
    assert usage.total_token_count == recorded_turn.prompt_len + len(recorded_turn.completion_ids)
    assert {c.response_id for c in chunks} == {recorded_turn.reply_id}
    # SSE data events, no [DONE], streamed live from the backend.
    raw = post(f"{proxy.url}/v1beta/models/qwen3:streamGenerateContent?alt=sse", json={"contents": [
        {"role": "user", "parts": [{"text": "Say hi"}]}]})  # fmt: skip
    assert raw.status_code == 200 and raw.headers["x-tito-stream"] == "live"
    events = [e for e in raw.content.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events) and b"[DONE]" not in raw.content
    assert json.loads(events[-1][6:])["candidates"][0]["finishReason"] == "STOP"


def test_count_tokens_is_the_prompt_the_turn_gets(proxy, replica) -> None:
    api = client(proxy)
    contents = [types.Content(role="user", parts=[types.Part(text="Count me")])]
    counted = api.models.count_tokens(model="qwen3", contents=contents)
    assert replica.generated() == [] and not proxy.record_dir.exists()
    api.models.generate_content(model="qwen3", contents=contents)
    assert counted.total_tokens == recorded(proxy.record_dir)[0].prompt_len
    wrapped = post(f"{proxy.url}/v1beta/models/qwen3:countTokens", json={"generateContentRequest": {
        "model": "models/qwen3", "contents": [{"role": "user", "parts": [{"text": "Count me"}]}]}})  # fmt: skip
    assert wrapped.status_code == 200 and wrapped.json()["totalTokens"] == counted.total_tokens


def test_any_model_name_reaches_the_backend_and_is_recorded_as_asked(proxy, replica) -> None:
    """Side calls under an alias, some asking for JSON; a `v1` path and a session in the path alike."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    api = client(proxy, "v1")
    side = api.models.generate_content(
        model="flash-lite",
        contents="Is this fine?",
        config=types.GenerateContentConfig(response_mime_type="application/json", response_json_schema=schema),
    )
    assert side.model_version == "flash-lite" and side.text is not None
    assert replica.received()[-1]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "response", "schema": schema}}  # fmt: skip
    named = post(f"{proxy.url}/sessions/run-7/v1beta/models/gemini-2.5-flash:generateContent", json={
        "contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 8, "topK": 5}})  # fmt: skip
    assert named.status_code == 200, named.text()
    sent = replica.received()[-1]
    assert (sent["max_tokens"], sent["top_k"]) == (8, 5), sorted(sent)
    turns = recorded(proxy.record_dir)
    assert [t.model for t in turns] == ["flash-lite", "gemini-2.5-flash"] and turns[1].session_id == "run-7"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA=="}}]}]},
         "inlineData"),
        ({"contents": [{"role": "user", "parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}},
         "candidateCount"),
        ({"contents": []}, "contents"),
        ({"contents": [{"role": "user", "parts": [{"text": "x"}]}], "cachedContent": "cachedContents/1"},
         "cachedContent"),
    ],
)  # fmt: skip
def test_bad_requests_are_google_errors_and_forward_nothing(proxy, replica, body, words) -> None:
    reply = post(f"{proxy.url}/v1beta/models/qwen3:generateContent", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT" and words in error["message"]
    assert replica.received() == [] and not proxy.record_dir.exists()


def test_the_sdk_reads_our_errors_as_google_errors(proxy, replica) -> None:
    image = types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")
    api = client(proxy)
    with pytest.raises(errors.ClientError) as raised:
        api.models.generate_content(model="qwen3", contents=[image])
    assert raised.value.code == 400 and raised.value.status == "INVALID_ARGUMENT"
    assert "inlineData" in raised.value.message
    assert replica.received() == []


def test_a_resumed_gemini_cli_history_extends_the_turns_it_repeats(proxy, replica) -> None:
    """What a resumed Gemini CLI session sends (it rebuilds the history from its session file): the signatures
    gone (the placeholder on the first call of a model content), the texts trimmed, and every function response twice
    in its content (`[A, A]`, `[A, B, A, B]`). The texts were shown trimmed, an exact repeat is read as nothing (noted),
    so the new prompt extends the last turn's exact ids; a different response under an answered id is refused."""
    declaration = WEATHER.model_dump(mode="json", exclude_none=True, by_alias=True)
    base = {"systemInstruction": {"parts": [{"text": "Be brief."}]}, "tools": [{"functionDeclarations": [declaration]}],
            "generationConfig": {"thinkingConfig": {"includeThoughts": True}}}  # fmt: skip
    url = f"{proxy.url}/v1beta/models/qwen3:streamGenerateContent?alt=sse"
    contents: list[dict] = [{"role": "user", "parts": [{"text": "Weather in Paris?"}]}]
    resumed: list[dict] = list(contents)
    for _ in range(4):  # one call, the answer, two calls (the replica's third turn), the answer
        reply = post(url, json={**base, "contents": contents})
        assert reply.status_code == 200, reply.text
        chunks = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
        parts = [part for chunk in chunks for part in chunk["candidates"][0]["content"]["parts"]]
        shown = [part for part in parts if not part.get("thought")]
        calls = [part["functionCall"] for part in shown if "functionCall" in part]
        outputs = [{"functionResponse": {"id": c["id"], "name": c["name"], "response": {"output": f"{c['id']}: 21 C"}}}
                   for c in calls]  # fmt: skip
        contents += [{"role": "model", "parts": shown}, {"role": "user", "parts": outputs or [{"text": "And Rome?"}]}]
        # The session file's reading: no signatures (the placeholder on the first call), each response twice.
        rebuilt = [{k: v for k, v in part.items() if k != "thoughtSignature"} for part in shown]
        first_call = next((part for part in rebuilt if "functionCall" in part), None)
        if first_call is not None:
            first_call["thoughtSignature"] = "skip_thought_signature_validator"
        resumed += [
            {"role": "model", "parts": rebuilt},
            {"role": "user", "parts": outputs * 2 or [{"text": "And Rome?"}]},
        ]
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [len(t.assistant_message.get("tool_calls") or []) for t in turns] == [1, 0, 2, 0]
    # An answer is shown without the whitespace around it (Qwen3's starts with the "\n\n" after </think>); the ids
    # keep it.
    answers = [t for t in turns if t.finish_reason == "stop"]
    for turn, content in zip(answers, (contents[3], contents[7]), strict=True):
        text = "".join(part.get("text", "") for part in content["parts"])
        assert text == text.strip() == turn.assistant_message["content"] and text
        assert turn.completion_ids[turn.completion_ids.index(151668) + 1] == 271  # "\n\n"

    reply = post(url, json={**base, "contents": resumed})
    assert reply.status_code == 200, reply.text
    turns = assert_token_exact(proxy.record_dir, replica)
    assert [t.parent_turn_id for t in turns] == [None, 0, 1, 2, 3]
    assert [m["role"] for m in turns[-1].appended_messages] == ["user"]
    repeats = [note for note in turns[-1].left_out or [] if "repeating an earlier one" in note]
    assert [note.split(":")[0] for note in repeats] == ["contents.2.parts.1", "contents.6.parts.2",
                                                        "contents.6.parts.3"]  # fmt: skip

    # A different response under an id its content already answered: which one the model reads is not for the proxy
    # to pick.
    served = len(replica.received())
    conflicting = [dict(content) for content in resumed]
    first, again = conflicting[2]["parts"]
    changed = {**again["functionResponse"], "response": {"output": "Paris: 30 C"}}
    conflicting[2] = {"role": "user", "parts": [first, {"functionResponse": changed}]}
    refused = post(url, json={**base, "contents": conflicting})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["status"] == "INVALID_ARGUMENT" and "contents.2.parts.1" in error["message"]
    assert "different functionResponse" in error["message"] and len(replica.received()) == served
