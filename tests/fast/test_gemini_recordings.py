"""A Gemini API session, recorded through a real mitmdump with the google-genai SDK as the agent and named by its
API key, works with every offline tool as the other APIs' sessions do: `show` rebuilds its exact prompts, `export`
gives the replica's exact ids as trainer rows, offline replay answers the same agent in the Gemini shape (whole and
streamed, countTokens too) with no backend, re-drive scores it, the drift audit reads it; and the episode holds its
calls as for the other APIs: a side call under another model name is a side call of the key's episode, and Gemini
CLI's compression its compaction, followed by the context rebuilt from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google import genai
from google.genai import errors, types
from support.basics import tokenizer_path
from support.gemini_agent import COMPRESSION_MODEL, THOUGHTS, TOOLS, results
from support.proxy_harness import Mitmdump, post
from support.tito_commands import replay_proxy, run_cli
from support.token_exact import assert_token_exact

from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

KEY = "sk-tito-gem-ep"  # the episode `gem-ep`, by the proxy's key prefix
EPISODE = "gem-ep"
SIDE_PROMPT = "Write a five word title for: Weather in Paris?"
# Gemini CLI 0.61's compression texts (bundle: `getCompressionPrompt`, `ChatCompressionService.compress`,
# `getInitialChatHistory`), the parts the proxy reads.
COMPRESSION_SYSTEM = ("You are a specialized system component responsible for distilling chat history into a "
                      "structured XML <state_snapshot>.")  # fmt: skip
SNAPSHOT_ASK = ("Generate a new <state_snapshot> based on the provided history.\n\nFirst, reason in your scratchpad. "
                "Then, generate the updated <state_snapshot>.")  # fmt: skip
VERIFY_ASK = ("Critically evaluate the <state_snapshot> you just generated. Did you omit any specific technical "
              "details, file paths, tool results, or user constraints mentioned in the history? If anything is missing "
              "or could be more precise, generate a FINAL, improved <state_snapshot>. Otherwise, repeat the exact same "
              "<state_snapshot> again.")  # fmt: skip
ENVIRONMENT = "This is the Gemini CLI. We are setting up the context for our chat.\nToday's date is Thursday."
# Each recorded turn: (parent, call, model).
PLACES = [(None, "main", "qwen3"), (0, "main", "qwen3"), (1, "main", "qwen3"), (2, "main", "qwen3"),
          (None, "side", "flash-lite"), (None, "compaction", COMPRESSION_MODEL),
          (None, "compaction", COMPRESSION_MODEL), (None, "main", "qwen3")]  # fmt: skip
CALLS = [call for _, call, _ in PLACES]


def client(url: str) -> genai.Client:
    options = types.HttpOptions(base_url=url, api_version="v1beta", retry_options=types.HttpRetryOptions(attempts=1))
    return genai.Client(api_key=KEY, http_options=options)


def config() -> types.GenerateContentConfig:
    return types.GenerateContentConfig(system_instruction="Be brief.", tools=TOOLS, thinking_config=THOUGHTS)


def generate(api: genai.Client, contents: list, stream: bool) -> types.GenerateContentResponse:
    """One turn as the agent sees it: a streamed one's chunks folded into one reply whose content the agent sends
    back (the thought text, the text, the calls; the one signature where a whole reply has it)."""
    if not stream:
        return api.models.generate_content(model="qwen3", contents=contents, config=config())
    chunks = list(api.models.generate_content_stream(model="qwen3", contents=contents, config=config()))
    assert {c.response_id for c in chunks} == {chunks[0].response_id}
    assert all(c.candidates[0].finish_reason is None for c in chunks[:-1]) and chunks[-1].candidates[0].finish_reason
    parts = [p for c in chunks for p in c.candidates[0].content.parts or []]
    thought = "".join(p.text for p in parts if p.thought)
    signatures = [p.thought_signature for p in parts if p.thought_signature]
    assert len(signatures) == 1
    text = "".join(p.text for p in parts if p.text is not None and not p.thought)
    merged = [types.Part(text=thought, thought=True)] if thought else []
    calls = [p for p in parts if p.function_call is not None]
    if text:
        merged.append(types.Part(text=text))
    merged += calls
    merged[1 if thought else 0].thought_signature = signatures[0]
    reply = chunks[-1].model_copy(deep=True)
    reply.candidates[0].content = types.Content(role="model", parts=merged)
    return reply


def gemini_session(api: genai.Client, stream: bool = False) -> tuple[list, list[types.Content]]:
    """The agent's loop: a tool round trip and its answer, a second user turn, another round trip and answer."""
    contents = [types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])]
    replies = []
    for follow_up in ("And Rome?", None):
        for _ in range(2):
            reply = generate(api, contents, stream)
            replies.append(reply)
            content = reply.candidates[0].content
            contents.append(content)
            if not any(p.function_call for p in content.parts):
                break
            contents.append(results(content))
        if follow_up:
            contents.append(types.Content(role="user", parts=[types.Part(text=follow_up)]))
    return replies, contents


def side_call(api: genai.Client) -> types.GenerateContentResponse:
    """A title request under another model name in the path, as Gemini CLI makes its side calls."""
    return api.models.generate_content(model="flash-lite", contents=SIDE_PROMPT)


def text(words: str, role: str = "user") -> types.Content:
    return types.Content(role=role, parts=[types.Part(text=words)])


def compaction(api: genai.Client, history: list[types.Content], stream: bool) -> list:
    """Gemini CLI's compression (0.61, `ChatCompressionService`), its requests as it sends them: the history under
    its compression system instruction, asked for a <state_snapshot>; the same history with that answer echoed,
    asked to check it; then a context rebuilt from the checked snapshot (its environment message first), which the
    agent goes on with. Returns the three replies."""
    compress = types.GenerateContentConfig(system_instruction=COMPRESSION_SYSTEM)
    asked = [*history, text(SNAPSHOT_ASK)]
    snapshot = api.models.generate_content(model=COMPRESSION_MODEL, contents=asked, config=compress)
    echoed = [*history, text(snapshot.text, "model"), text(VERIFY_ASK)]
    checked = api.models.generate_content(model=COMPRESSION_MODEL, contents=echoed, config=compress)
    rebuilt = [text(ENVIRONMENT), text((checked.text or snapshot.text).strip()),
               text("Got it. Thanks for the additional context!", "model"), text("Go on.")]  # fmt: skip
    return [snapshot, checked, generate(api, rebuilt, stream)]


def episode(api: genai.Client, stream: bool = False) -> tuple[list, list[types.Content]]:
    """The main loop, a side call, then a compaction and the rebuilt context: every reply, and the main contents."""
    replies, contents = gemini_session(api, stream)
    return [*replies, side_call(api), *compaction(api, contents, stream)], contents


def view(reply: types.GenerateContentResponse) -> list:
    """What the agent acts on: the parts (thought or not, text, function call id, name and args) and the finish."""
    parts = reply.candidates[0].content.parts or []
    calls = [(p.function_call.id, p.function_call.name, p.function_call.args) if p.function_call else None
             for p in parts]  # fmt: skip
    return [([(bool(p.thought), p.text) for p in parts], calls, reply.candidates[0].finish_reason)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("rec")
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), preferred_tools={"get_weather": {"city": "Paris"}})
    with ReplicaThread(config) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent,
        options={"tito_session_api_key_prefix": "sk-tito-"},
    ) as proxy:  # fmt: skip
        replies, contents = episode(client(proxy.url))
        turns = assert_token_exact(record_dir, replica)
        generated = replica.generated()
        headers = list(replica.backend.received_headers)
        log = proxy.output()
    assert [r.candidates[0].finish_reason for r in replies] == [types.FinishReason.STOP] * 8
    assert [bool(any(p.function_call for p in r.candidates[0].content.parts)) for r in replies] == [
        True, False, True, False, False, False, False, True
    ]  # fmt: skip
    return {"dir": record_dir, "replies": replies, "contents": contents, "turns": turns, "generated": generated,
            "headers": headers, "log": log}  # fmt: skip


def test_the_key_names_the_episode_and_each_call_is_placed_in_it(recorded) -> None:
    """The side call under `flash-lite` is a side call of the key's episode; Gemini CLI's compression (two new roots
    under its own system instruction) is its compaction, and the rebuilt context continues the main call, following
    the turn whose snapshot it holds."""
    turns = recorded["turns"]
    assert {t.session_id for t in turns} == {EPISODE} and {t.episode for t in turns} == {EPISODE}
    assert [(t.parent_turn_id, t.call, t.model) for t in turns] == PLACES
    assert [t.turn_id for t in turns] == list(range(8)) and all(t.api == "gemini" for t in turns)
    assert "no recorded summary" in turns[4].call_reason
    assert [t.call_reason for t in turns[5:7]] == ["Gemini CLI's compaction instruction"] * 2
    assert [t.follows.model_dump(exclude_none=True) if t.follows else None for t in turns] == [None] * 7 + [
        {"session": EPISODE, "turn_id": 6, "how": "summary"}
    ]
    assert [t.reply_id for t in turns] == [r.response_id for r in recorded["replies"]]
    # The key is removed before the request goes anywhere (no backend key is set): neither the backend, nor a record
    # line, nor the log sees it.
    assert len(recorded["headers"]) == 8 and not any(
        KEY in value for sent in recorded["headers"] for value in sent.values()
    )
    files = [p.read_text("utf-8") for p in recorded["dir"].rglob("*") if p.is_file()]
    assert files and not any(KEY in text for text in [*files, recorded["log"]])


def test_show_rebuilds_the_exact_prompts(recorded) -> None:
    shown = [json.loads(line) for line in run_cli("show", str(recorded["dir"]), "--json").stdout.splitlines()]
    assert [(t["session_id"], t["turn_id"], t["api"], t["call"], t["episode"]) for t in shown] == [
        (EPISODE, i, "gemini", call, EPISODE) for i, call in enumerate(CALLS)
    ]
    assert [(t["prompt_ids"], t["completion_ids"]) for t in shown] == [
        (g["prompt_ids"], g["completion_ids"]) for g in recorded["generated"]
    ]
    assert [t["reply_id"] for t in shown] == [t.reply_id for t in recorded["turns"]]
    summary = run_cli("show", str(recorded["dir"])).stdout.splitlines()
    assert summary[0] == f"session {EPISODE} ({EPISODE}.jsonl): 8 turns, closed (shutdown)", summary
    calls = ["→ get_weather" in line for line in summary if line.startswith("  turn ")]  # each turn's head line
    assert calls == [True, False, True, False, False, False, False, True], summary


def test_export_rows_are_the_replicas_exact_ids(recorded, tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    run_cli("export", str(recorded["dir"]), str(out), "--to", "jsonl")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["episode"], r["segment"], r["call"], r["turn_ids"]) for r in rows] == [
        (EPISODE, 0, "main", [0, 1, 2, 3]), (EPISODE, 1, "side", [4]), (EPISODE, 2, "compaction", [5]),
        (EPISODE, 3, "compaction", [6]), (EPISODE, 4, "main", [7]),
    ]  # fmt: skip
    assert len({r["rollout_id"] for r in rows}) == 1
    generated = recorded["generated"]
    for row in rows:
        leaf = generated[row["leaf_turn_id"]]
        assert row["input_ids"] == leaf["prompt_ids"] + leaf["completion_ids"]
        # The mask is 1 on exactly the tokens the replica sampled, in every turn of the segment.
        sampled = [i for i, bit in enumerate(row["loss_mask"]) if bit]
        expected = [len(generated[t]["prompt_ids"]) + k for t in row["turn_ids"]
                    for k in range(len(generated[t]["completion_ids"]))]  # fmt: skip
        assert sampled == expected
        assert [row["input_ids"][i] for i in sampled] == [i for t in row["turn_ids"]
                                                          for i in generated[t]["completion_ids"]]  # fmt: skip
    kept = tmp_path / "main.jsonl"
    run_cli("export", str(recorded["dir"]), str(kept), "--to", "jsonl", "--calls", "main,compaction")
    assert [json.loads(line)["segment"] for line in kept.read_text().splitlines()] == [0, 2, 3, 4]


@pytest.mark.parametrize("stream", [False, True])
def test_offline_replay_answers_the_same_agent_in_the_gemini_shape(recorded, tmp_path: Path, stream: bool) -> None:
    """The whole episode again, with no backend: the main loop (streamed when asked), the side call, the compaction
    and the rebuilt context, each answered with the recorded turn, so each next request matches the next turn."""
    replies, contents = recorded["replies"], recorded["contents"]
    with replay_proxy(recorded["dir"], tmp_path) as proxy:
        api = client(proxy.url)
        again, again_contents = episode(api, stream)
        # The SDK's countTokens sends the contents alone (no system instruction or tools): the side call's prompt.
        counted = api.models.count_tokens(model="flash-lite", contents=SIDE_PROMPT)
        # Gemini CLI's form, a whole request wrapped: the prompt of the turn that read the function's result.
        wrapped = {"model": "models/qwen3", "systemInstruction": {"parts": [{"text": "Be brief."}]},
                   "tools": [t.model_dump(mode="json", exclude_none=True, by_alias=True) for t in TOOLS],
                   "contents": [c.model_dump(mode="json", exclude_none=True, by_alias=True)
                                for c in again_contents[:3]]}  # fmt: skip
        counted_turn = post(f"{proxy.url}/v1beta/models/qwen3:countTokens", json={"generateContentRequest": wrapped})
        with pytest.raises(errors.ClientError) as missed:
            api.models.generate_content(model="qwen3", contents="Never asked.")
    # The same parts (thoughts, text, function call ids, names and args) and the recorded turn's usage.
    assert [view(r) for r in again] == [view(r) for r in replies]
    assert [r.usage_metadata.model_dump() for r in again] == [r.usage_metadata.model_dump() for r in replies]
    assert [r.model_version for r in again] == [model for _, _, model in PLACES]
    # The main loop's replies carry one signature each, which the SDK sent back.
    assert all(sum(bool(p.thought_signature) for p in r.candidates[0].content.parts) == 1 for r in again[:4])
    assert [c.model_dump(exclude={"parts": {"__all__": {"thought_signature"}}}) for c in again_contents] == [
        c.model_dump(exclude={"parts": {"__all__": {"thought_signature"}}}) for c in contents
    ]
    assert counted.total_tokens == recorded["turns"][4].prompt_len
    assert counted_turn.status_code == 200, counted_turn.text()
    assert counted_turn.json()["totalTokens"] == recorded["turns"][1].prompt_len
    assert missed.value.code == 404 and missed.value.status == "NOT_FOUND", missed.value.details
    assert missed.value.details["error"]["matched_messages"] == 0


@pytest.mark.parametrize("shift", [0.0, 0.25])
def test_redrive_scores_the_recorded_ids(recorded, tmp_path: Path, shift: float) -> None:
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), checkpoint_shift=shift)
    with ReplicaThread(config) as newer:
        out = tmp_path / "redrive.json"
        assert "total:" in run_cli("redrive", str(recorded["dir"]), "--backend", newer.url, "--json", str(out)).stdout
        bodies = list(newer.backend.scored)
        assert newer.received() == [], "scoring uses native /generate, never the chat endpoint"
    report = json.loads(out.read_text())
    generated = recorded["generated"]
    assert [b["input_ids"] for b in bodies] == [g["prompt_ids"] + g["completion_ids"] for g in generated]
    assert [b["logprob_start_len"] for b in bodies] == [len(g["prompt_ids"]) for g in generated]
    assert [(t["turn_id"], t["episode"], t["call"]) for t in report["turns"]] == [
        (i, EPISODE, call) for i, call in enumerate(CALLS)
    ]
    assert {call: totals["turns"] for call, totals in report["by_call"].items()} == {
        "main": 5, "side": 1, "compaction": 2
    }  # fmt: skip
    assert report["totals"]["tokens"] == sum(len(g["completion_ids"]) for g in generated)
    for turn in report["turns"]:
        assert turn["kl_estimate"] == pytest.approx(shift) and turn["max_abs_diff"] == pytest.approx(shift)


def test_drift_audit_reads_the_session(recorded, tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    assert "5 branches" in run_cli("audit", str(recorded["dir"]), "--json", str(out)).stdout
    by_leaf = {branch["leaf_turn_id"]: branch for branch in json.loads(out.read_text())}
    assert sorted(by_leaf) == [3, 4, 5, 6, 7] and {b["session_id"] for b in by_leaf.values()} == {EPISODE}
    main = by_leaf[3]
    # The stock Qwen3 template drops the think blocks once a new user turn arrives, and adds a newline after the
    # last <|im_end|>; the replica's non-canonical splits re-split: each found from the ids.
    assert main["kinds"].get("stripped_think", 0) >= 1
    assert main["kinds"].get("eos_newline", 0) >= 1
    assert main["kinds"].get("bpe_resplit", 0) >= 1
    assert set(main["differing_tokens_per_turn"]) == {"0", "1", "2", "3"}


def test_a_later_compaction_follows_the_snapshot_its_history_starts_from(tmp_path: Path) -> None:
    """Gemini CLI's second compression of a session (seen with the CLI itself, full/test_agent_episodes.py) sends a
    history that starts from the first checked snapshot: both its requests are compactions following the first check
    turn (the summary they hold), and the context rebuilt from the second snapshot follows the second check turn and
    continues `main`."""
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), preferred_tools={"get_weather": {"city": "Paris"}})
    with ReplicaThread(config) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path,
        options={"tito_session_api_key_prefix": "sk-tito-"},
    ) as proxy:  # fmt: skip
        api = client(proxy.url)
        _, contents = gemini_session(api)
        first = compaction(api, contents, stream=False)
        # The rebuilt context's round trip and answer, as the agent goes on with it, then compressed again.
        rebuilt = [text(ENVIRONMENT), text(first[1].text.strip()), text("Got it. Thanks for the additional context!",
                   "model"), text("Go on."), first[2].candidates[0].content]  # fmt: skip
        rebuilt.append(results(rebuilt[-1]))
        answer = generate(api, rebuilt, stream=False)
        second = compaction(api, [*rebuilt, answer.candidates[0].content], stream=False)
        turns = assert_token_exact(tmp_path / "rec", replica)
    assert [(t.parent_turn_id, t.call) for t in turns] == [
        (None, "main"), (0, "main"), (1, "main"), (2, "main"), (None, "compaction"), (None, "compaction"),
        (None, "main"), (6, "main"), (None, "compaction"), (None, "compaction"), (None, "main"),
    ]  # fmt: skip
    assert [t.reply_id for t in turns[4:]] == [r.response_id for r in [*first, answer, *second]]
    follows = [(t.follows.turn_id, t.follows.how) if t.follows else None for t in turns]
    assert follows == [None] * 6 + [(5, "summary"), None, (5, "summary"), (5, "summary"), (9, "summary")]
    assert {t.episode for t in turns} == {EPISODE}
