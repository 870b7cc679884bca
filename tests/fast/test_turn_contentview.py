"""The "TITO turn" content view: a flow that became a turn shows its tokens (the prompt's new part, the completion,
each id with its text, special tokens marked, sampled tokens shaded by log-prob) and its place (session, turn,
parent, episode, segment, call); a refused flow shows why; other flows are left to mitmproxy's views.

Proven three ways: through mitmproxy's own contentview helpers on flows a real mitmdump captured (`-w`) for every
agent API, streamed and whole, checked against the record file on disk; on hand-made metadata for what a capture does
not produce (odd metadata, weight updates inside a turn, tokenizers the view must not use); and in a real mitmweb
opened in headless Chromium, where a turn sent through the proxy shows its ids in the page.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import openai
import pytest
from google import genai
from google.genai import types
from mitmproxy import contentviews, http
from mitmproxy.contentviews import ContentviewResult
from mitmproxy.contentviews._registry import ContentviewRegistry
from mitmproxy.io import FlowReader
from mitmproxy.test import taddons, tflow
from support.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from support.anthropic_agent import echo as anthropic_echo
from support.anthropic_agent import tool_results
from support.basics import REPO, cached_engine, cached_tokenizer, tokenizer_path
from support.chat_agent import agent, run_agent
from support.gemini_agent import TOOLS as GEMINI_TOOLS
from support.gemini_agent import results as gemini_results
from support.headless_chromium import HeadlessChromium
from support.proxy_harness import Mitmdump, post
from support.responses_agent import echo as responses_echo
from support.responses_agent import outputs

from tito_addon.proxy.flow_file_records import FlowFileRecords
from tito_addon.proxy.token_contentview import VIEW_NAME, TurnContentview, TurnViewRegistration
from tito_addon.proxy.turn_wiring import TurnWiring
from tito_addon.records.episode_segments import episode_segments
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import iter_session_files
from tito_addon.records.turn_tokens import shade
from tito_addon.replicas.fleet import free_port
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather for a city.",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]  # fmt: skip
# The keys the refused requests carry: none may reach a flow's metadata.
REFUSED_KEY = "sk-agent"


# -- reading the view's text back ---------------------------------------------------------------------------------


@dataclass
class ShownTurn:
    """The content view's text, parsed: its head (label -> value) and its token lines."""

    head: dict[str, str] = field(default_factory=dict)
    prompt: list[tuple[int, int, str]] = field(default_factory=list)  # position, id, shown text
    completion: list[tuple[int, str, str, int, str, str | None]] = field(default_factory=list)
    # position, shade, log-prob as printed, id, shown text, weights named on the line

    @property
    def prompt_ids(self) -> list[int]:
        return [token for _, token, _ in self.prompt]

    @property
    def completion_ids(self) -> list[int]:
        return [line[3] for line in self.completion]


def parse_view(text: str) -> ShownTurn:
    shown, section = ShownTurn(), "head"
    for raw in text.replace("\xa0", " ").splitlines():  # mitmweb draws an empty line as a no-break space
        line = raw.rstrip() if raw.strip() else ""
        if (first := re.fullmatch(r"tito turn (\d+) of session (.+)", line)) is not None:
            shown.head["turn"], shown.head["session"] = first.group(1), first.group(2)
        elif line.startswith("── prompt"):
            section = "prompt"
        elif line.startswith("── completion"):
            section = "completion"
        elif section == "head" and (fact := re.fullmatch(r"  (\S+(?: \S+)?) {2,}(.*)", line)) is not None:
            shown.head[fact.group(1)] = fact.group(2)
        elif section == "prompt" and re.fullmatch(r" *\d+ +\d+(  .*)?", line):
            shown.prompt.append((int(line[:7]), int(line[9:16]), line[18:]))
        elif section == "completion" and re.fullmatch(r" *\d+  . +-?\d+\.\d{4} +\d+(  .*)?", line):
            text_and_weights = re.fullmatch(r"(⟦.*⟧|“.*”|)(?:  w=(.*))?", line[31:])
            assert text_and_weights is not None, line
            token_text, weights = text_and_weights.groups()
            shown.completion.append(
                (int(line[:7]), line[9], line[11:20].strip(), int(line[22:29]), token_text, weights)
            )
    return shown


def visible(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")


def expected_segment(record_dir: Path, turn: TurnRecord) -> str:
    """The export's numbering of the first segment whose path holds the turn (a branch point is in several)."""
    for segment in episode_segments(iter_session_files(record_dir)):
        if segment.path[0].session_id == turn.session_id and turn.turn_id in [t.turn_id for t in segment.path]:
            return f"{segment.index} (from turn {segment.path[0].turn_id}, {turn.call})"
    raise AssertionError(f"turn {turn.turn_id} of {turn.session_id} is in no segment")


def assert_shows_turn(text: str, turn: TurnRecord, *, segment: str | None = None, texts: bool = True) -> ShownTurn:
    """The view's text shows exactly this turn: its place, every id in order with its position, each sampled
    token's log-prob and shade, each token's own text, special tokens marked."""
    shown = parse_view(text)
    parent = "none (a root)" if turn.parent_turn_id is None else str(turn.parent_turn_id)
    assert (shown.head["session"], shown.head["turn"]) == (turn.session_id, str(turn.turn_id))
    assert (shown.head["parent turn"], shown.head["episode"], shown.head["call"]) == (
        parent,
        turn.episode_id,
        turn.call,
    )
    assert shown.head["api"] == turn.api
    assert shown.head.get("segment") == segment
    assert shown.prompt_ids == turn.prompt_added_ids and shown.completion_ids == turn.completion_ids
    first = turn.prompt_len - len(turn.prompt_added_ids)
    assert [pos for pos, _, _ in shown.prompt] == list(range(first, turn.prompt_len))
    assert [line[0] for line in shown.completion] == list(
        range(turn.prompt_len, turn.prompt_len + len(turn.completion_ids))
    )
    assert [line[2] for line in shown.completion] == [f"{lp:.4f}" for lp in turn.completion_logprobs]
    assert [line[1] for line in shown.completion] == [shade(lp) for lp in turn.completion_logprobs]
    lines = [(token, text) for _, token, text in shown.prompt] + [(c[3], c[4]) for c in shown.completion]
    if not texts:
        assert {text for _, text in lines} == {""} and "(no tokenizer loaded: ids only)" in text
        return shown
    tokenizer = cached_tokenizer("qwen3")
    specials = set(tokenizer.all_special_ids)
    specials |= {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}
    for token, shown_text in lines:
        own = tokenizer.decode([token], skip_special_tokens=False)
        assert shown_text == (f"⟦{own}⟧" if token in specials else f"“{visible(own)}”"), (token, shown_text)
    assert any(token in specials for token, _ in lines), "a chat turn's prompt holds special tokens to mark"
    return shown


# -- a real capture -----------------------------------------------------------------------------------------------


@dataclass
class Capture:
    record_dir: Path
    flows: list[http.HTTPFlow]


def anthropic_turns(client: anthropic.Anthropic) -> None:
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.messages.create(model="qwen3", max_tokens=256, tools=ANTHROPIC_TOOLS, messages=messages)
    messages += [anthropic_echo(reply), tool_results(reply) if reply.stop_reason == "tool_use" else
                 {"role": "user", "content": "And Rome?"}]  # fmt: skip
    with client.messages.stream(model="qwen3", max_tokens=256, tools=ANTHROPIC_TOOLS, messages=messages) as running:
        running.get_final_message()


def responses_turns(client: openai.OpenAI) -> None:
    items: list[dict] = [{"role": "user", "content": "Weather in Rome?"}]
    reply = client.responses.create(model="qwen3", input=items, tools=RESPONSES_TOOLS)
    items += [*responses_echo(reply), *(outputs(reply) or [{"role": "user", "content": "And Oslo?"}])]
    client.responses.create(model="qwen3", input=items, tools=RESPONSES_TOOLS)


def gemini_turns(url: str) -> None:
    retry = types.HttpRetryOptions(attempts=1)
    options = types.HttpOptions(
        base_url=url, api_version="v1beta", retry_options=retry, headers={"x-session-id": "gemini"}
    )
    client = genai.Client(api_key="gemini-client-key", http_options=options)
    config = types.GenerateContentConfig(tools=GEMINI_TOOLS)
    contents = [types.Content(role="user", parts=[types.Part(text="Weather in Paris?")])]
    reply = client.models.generate_content(model="qwen3", contents=contents, config=config)
    content = reply.candidates[0].content
    follow = gemini_results(content) if any(p.function_call for p in content.parts) else types.Content(
        role="user", parts=[types.Part(text="And Rome?")])  # fmt: skip
    list(client.models.generate_content_stream(model="qwen3", contents=[*contents, content, follow], config=config))


def refuse_each_api(url: str) -> None:
    """One request each API refuses before the backend, each carrying an API key."""
    auth = {"authorization": f"Bearer {REFUSED_KEY}", "x-api-key": REFUSED_KEY}
    assert post(url + "/v1/chat/completions", json={"model": "m", "messages": []}, headers=auth).status_code == 400
    assert post(url + "/v1/messages", json={"model": "m", "messages": []}, headers=auth).status_code == 400
    gemini = url + "/v1beta/models/qwen3:generateContent"
    assert post(gemini, json={"contents": "not a list"}, headers=auth).status_code == 400


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Capture:
    root = tmp_path_factory.mktemp("captured")
    record_dir, flow_file = root / "rec", root / "flows.mitm"  # the flow file is outside the audited record dir
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=root,
        extra_args=["-w", str(flow_file)],
    ) as proxy:  # fmt: skip
        run_agent(agent(proxy, "chat"), 2)
        # A second root of the named session: a side call, its own segment.
        agent(proxy, "chat").chat.completions.create(model="m", messages=[{"role": "user", "content": "A title?"}])
        run_agent(agent(proxy, "chat-stream"), 2, stream=True)
        headers = {"x-session-id": "anthropic"}
        anthropic_turns(
            anthropic.Anthropic(base_url=proxy.url, api_key="sk-client", max_retries=0, default_headers=headers)
        )
        headers = {"x-session-id": "responses"}
        responses_turns(
            openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, default_headers=headers)
        )
        gemini_turns(proxy.url)
        refuse_each_api(proxy.url)
    with flow_file.open("rb") as stream:
        flows = [f for f in FlowReader(stream).stream() if isinstance(f, http.HTTPFlow)]
    return Capture(record_dir, flows)


def view_for(record_dir: Path) -> TurnContentview:
    """The view as the running addon has it: its wiring's engine (the record's tokenizer) and record dir."""
    wiring = TurnWiring()
    wiring.engine = cached_engine("qwen3")
    wiring.facts.record_dir = str(record_dir)
    return TurnContentview(wiring)


def registry_with(view: TurnContentview) -> ContentviewRegistry:
    """mitmproxy's views and this one, in a registry of the test's own (the process's stays as it was)."""
    registry = ContentviewRegistry()
    for builtin in contentviews.registry.values():
        registry.register(builtin)
    registry.register(view)
    return registry


def pretty(
    message: http.Message, flow: http.HTTPFlow, registry: ContentviewRegistry, name: str = "auto"
) -> ContentviewResult:
    with taddons.context():
        return contentviews.prettify_message(message, flow, view_name=name, registry=registry)


def test_every_captured_turn_shows_its_recorded_tokens(captured: Capture) -> None:
    """Each flow the proxy answered as a turn (chat whole and streamed, Anthropic, Responses, Gemini) opens in the
    TITO view by default, and shows the record on disk: the same ids, log-probs, place and segment."""
    on_disk = {(t.session_id, t.turn_id): t for f in iter_session_files(captured.record_dir) for t in f.turns}
    registry = registry_with(view_for(captured.record_dir))
    turn_flows = [f for f in captured.flows if "record" in f.metadata.get("tito", {})]
    assert len(turn_flows) == len(on_disk) == 11
    shown = set()
    for flow in turn_flows:
        turn = TurnRecord.model_validate(flow.metadata["tito"]["record"])
        assert turn == on_disk[(turn.session_id, turn.turn_id)]
        streamed = flow.response.headers.get("x-tito-stream") == "live"
        # A streamed turn's response body was relayed, not kept: its request shows the turn.
        assert (flow.response.content is None) == streamed
        shown.add((turn.api, streamed))
        for message in [flow.request] if streamed else [flow.request, flow.response]:
            result = pretty(message, flow, registry)
            assert result.view_name == VIEW_NAME
            assert_shows_turn(result.text, turn, segment=expected_segment(captured.record_dir, turn))
    assert {api for api, _ in shown} == {"chat", "anthropic_messages", "openai_responses", "gemini"}
    assert {("chat", True), ("chat", False), ("anthropic_messages", True), ("gemini", True)} <= shown


def test_the_side_call_is_shown_in_its_own_segment(captured: Capture) -> None:
    registry = registry_with(view_for(captured.record_dir))
    chat = [f for f in captured.flows if f.metadata.get("tito", {}).get("session_id") == "chat"]
    heads = [parse_view(pretty(f.response, f, registry).text).head for f in chat]
    assert [(h["turn"], h["call"], h["segment"]) for h in heads] == [
        ("0", "main", "0 (from turn 0, main)"), ("1", "main", "0 (from turn 0, main)"),
        ("2", "side", "1 (from turn 2, side)"),
    ]  # fmt: skip


def test_a_refused_request_shows_why_and_keeps_no_key(captured: Capture, tmp_path: Path) -> None:
    """Each API's refusal: the view says the status, the error's type and message, that nothing was recorded; the
    metadata holds no header, so no API key; and re-reading the flow file records nothing from it."""
    registry = registry_with(view_for(captured.record_dir))
    refused = [f for f in captured.flows if "refused" in f.metadata.get("tito", {})]
    assert [f.request.path.split("/")[-1] for f in refused] == ["completions", "messages", "qwen3:generateContent"]
    for flow in refused:
        assert REFUSED_KEY not in json.dumps(flow.metadata) and REFUSED_KEY in str(flow.request.headers)
        error = json.loads(flow.response.content)["error"]
        kind = error.get("type") or error.get("status")
        for message in (flow.request, flow.response):
            result = pretty(message, flow, registry)
            assert result.view_name == VIEW_NAME
            assert result.text.startswith(f"tito refused this request: HTTP {flow.response.status_code}\n")
            assert f"  error type    {kind}\n  message       {error['message']}\n" in result.text
            assert "nothing was recorded" in result.text
    wiring = TurnWiring()
    wiring.facts.record_dir = str(tmp_path / "again")
    for flow in refused:
        flow.live = False
        FlowFileRecords(wiring).response(flow)
    assert not (tmp_path / "again").exists()


# -- hand-made metadata -------------------------------------------------------------------------------------------


def flow_with(tito: object | None, body: bytes = b'{"model": "m"}') -> http.HTTPFlow:
    flow = tflow.tflow(resp=True)
    for message in (flow.request, flow.response):
        message.content = body
        message.headers["content-type"] = "application/json"
    if tito is not None:
        flow.metadata["tito"] = tito
    return flow


def a_turn(captured: Capture) -> dict:
    return next(f.metadata["tito"]["record"] for f in captured.flows if "record" in f.metadata.get("tito", {}))


def test_a_flow_that_is_no_turn_is_left_to_mitmproxys_views(captured: Capture) -> None:
    view = view_for(captured.record_dir)
    registry = registry_with(view)
    for tito in (None, {"replayed": True, "session_id": "s", "turn_id": 3}, {"session_id": "s"}):
        flow = flow_with(tito)
        result = pretty(flow.response, flow, registry)
        assert result.view_name == "JSON" and json.loads(result.text) == {"model": "m"}
        chosen = pretty(flow.response, flow, registry, name=VIEW_NAME)  # asked for by name, it says why not
        assert chosen.view_name == VIEW_NAME and ("Not a tito turn" in chosen.text or "replayed" in chosen.text)


@pytest.mark.parametrize(
    ("tito", "says"),
    [
        ({"record": ["not", "a", "dict"]}, "is not an object but list"),
        ({"record": {"session_id": "s"}}, "is not a valid turn record"),
        ({"refused": "teapot"}, "refusal metadata is not an object but str"),
        ({"refused": {"status": 502, "error": "upstream reset"}}, "message       upstream reset"),
    ],
)
def test_odd_metadata_is_said_not_raised(captured: Capture, tito: dict, says: str) -> None:
    registry = registry_with(view_for(captured.record_dir))
    flow = flow_with(tito)
    result = pretty(flow.response, flow, registry)
    assert result.view_name == VIEW_NAME and says in result.text


def test_log_probs_that_do_not_match_the_ids_are_said(captured: Capture) -> None:
    line = {**a_turn(captured), "completion_logprobs": [-0.5]}
    flow = flow_with({"record": line})
    assert "log-probs for" in pretty(flow.response, flow, registry_with(view_for(captured.record_dir))).text


def test_each_tokens_weights_are_named_where_they_changed_inside_the_turn(captured: Capture) -> None:
    line = dict(a_turn(captured))
    count = len(line["completion_ids"])
    half = count // 2
    line["weight_version"] = "v2"
    line["weight_version_spans"] = [
        {"version": "v1", "start": 0, "end": half},
        {"version": "v2", "start": half, "end": count},
    ]
    flow = flow_with({"record": line})
    shown = parse_view(pretty(flow.response, flow, registry_with(view_for(captured.record_dir))).text)
    assert shown.head["weights"] == "v2"
    assert [c[5] for c in shown.completion] == ["v1"] * half + [None] * (count - half)


def engineless_registry(tmp_path: Path) -> ContentviewRegistry:
    """The view of a proxy with no token engine (`mitmweb -r flows` without a tokenizer), no sessions recorded."""
    wiring = TurnWiring()
    wiring.facts.record_dir = str(tmp_path)
    return registry_with(TurnContentview(wiring))


def test_without_an_engine_the_records_local_tokenizer_names_the_ids(captured: Capture, tmp_path: Path) -> None:
    """The record's tokenizer directory is loaded when its fingerprint is the record's; one of another fingerprint
    is not used (ids only)."""
    line = a_turn(captured)
    if not Path(line["tokenizer"]["name"]).is_dir():
        pytest.skip("the tokenizer is a hub id here (no ../shared/tokenizers)")
    registry = engineless_registry(tmp_path)
    flow = flow_with({"record": line})
    assert_shows_turn(pretty(flow.response, flow, registry).text, TurnRecord.model_validate(line))
    other = {**line, "tokenizer": {**line["tokenizer"], "tokenizer_sha256": "0" * 64}}
    flow = flow_with({"record": other})
    text = pretty(flow.response, flow, registry).text
    assert_shows_turn(text, TurnRecord.model_validate(other), texts=False)
    assert "is not the one this turn was recorded with (its sha256 differs)" in text


def test_a_tokenizer_that_is_no_local_directory_gives_ids_only(captured: Capture, tmp_path: Path) -> None:
    """A hub id is never downloaded by a view: the ids are shown alone, and the view says why."""
    line = a_turn(captured)
    hub = {**line, "tokenizer": {**line["tokenizer"], "name": "Qwen/Qwen3-8B"}}
    flow = flow_with({"record": hub})
    text = pretty(flow.response, flow, engineless_registry(tmp_path)).text
    assert_shows_turn(text, TurnRecord.model_validate(hub), texts=False)
    assert "(ids only: the recorded tokenizer 'Qwen/Qwen3-8B' is not a local directory here)" in text


def test_the_addon_registers_the_view_while_loaded() -> None:
    """`load` registers it with mitmproxy; a hot reload's new view replaces it by name; the old addon's `done` does
    not take the new one out, and the last `done` leaves no view behind."""
    key = VIEW_NAME.lower()
    first, second = TurnViewRegistration(TurnWiring()), TurnViewRegistration(TurnWiring())
    with taddons.context() as context:
        context.master.addons.add(first)
        assert contentviews.registry[key] is first.view
        second.load(None)  # a hot reload: the new script's addon loads, then the old one is removed
        context.master.addons.remove(first)
        assert contentviews.registry[key] is second.view
        second.done()
        assert key not in contentviews.registry
    flow = flow_with({"refused": {"status": 400}})
    assert second.view.render_priority(b"{}", contentviews.Metadata(flow=flow)) < 0


# -- a real mitmweb, in a real browser ----------------------------------------------------------------------------


def test_mitmweb_shows_a_captured_turn_in_chromium(tmp_path: Path) -> None:
    """A turn sent through a real `mitmweb -s tito_addon/__init__.py` by the openai SDK: its flow, opened in
    mitmweb's page in headless Chromium, shows the TITO view by default with the recorded ids."""
    password, web_port = secrets.token_hex(12), free_port()
    web = ["--set", f"web_port={web_port}", "--set", "web_open_browser=false", "--set", f"web_password={password}"]
    record_dir = tmp_path / "rec"
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, program="mitmweb",
        extra_args=web,
    ) as proxy, HeadlessChromium(tmp_path) as browser:  # fmt: skip
        agent(proxy, "web").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Weather in Paris?"}]
        )
        turn = next(iter_session_files(record_dir)).turns[0]
        page = browser.new_page(f"http://127.0.0.1:{web_port}/?token={password}", width=1400, height=1000)
        page.wait_for("document.querySelector('.flow-table tbody tr.has-response')", timeout=30)
        page.click(".flow-table tbody tr.has-response")
        page.click(".flow-detail nav a:nth-of-type(2)")  # the Response tab
        shown = ".flow-detail section.response .contentview"
        page.wait_for(
            f"document.querySelector('{shown} pre')?.innerText.includes('tito turn 0 of session web')", timeout=30
        )
        assert page.evaluate(f"document.querySelector('{shown} h5').textContent") == VIEW_NAME
        assert_shows_turn(
            page.evaluate(f"document.querySelector('{shown} pre').innerText"), turn, segment="0 (from turn 0, main)"
        )
        png = page.screenshot(tmp_path / "mitmweb-turn-view.png")
        facts = browser.image_facts(png)
        assert (facts.width, facts.height) == (1400, 1000)
        assert facts.colours > 50 and facts.background_share < 0.9, facts  # text drawn, not a blank page
        assert not [line for line in page.console if line.startswith("uncaught")], page.console
    screenshots = os.environ.get("TITO_SCREENSHOTS")
    if screenshots:  # the README's picture: `TITO_SCREENSHOTS=docs/screenshots`
        target = REPO / screenshots / "mitmweb-turn-view.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(png)
