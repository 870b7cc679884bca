"""The record browser (`python -m tito_addon view`) driven in headless Chromium over a record made through a real
mitmdump: a named Claude Code episode (a compaction, the context rebuilt from its summary, a sub-agent, a side call;
the real anthropic SDK), a GRPO group of three scored chat sessions and a session with a branch (openai-python), all
closed through the control API.

What the page shows is checked against the record and the export: the rollout table's rows, filters and order; the
sessions table against the control API's list; an episode's segments and links against the export's segments; a
turn's tokens, their log-probs and shades against its record line; a group; one episode as a file that asks no
server; and a record dir with torn lines, foreign files and a link out of the dir, with URLs that try to leave it.
Screenshots are checked for what they show (their pixels, decoded by the browser), and kept where `TITO_SCREENSHOTS`
names a dir (the README's come from there).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.chat_agent import agent, run_agent
from support.episode_scripts import SUBAGENT_PROMPT, claude_code_episode
from support.headless_chromium import HeadlessChromium, Page, chromium_binary
from support.proxy_harness import REPO, get
from support.record_view import running_view, screenshot, shown, texts

from tito_addon.client import TitoClient
from tito_addon.records.record_reader import iter_session_files, read_session
from tito_addon.replicas.proxy_process import Mitmdump
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

TOKEN = "control-token-browser-0123456789"
GROUP = "task-7"
HOSTILE = "</script><img src=x onerror=window.pwned=1>"
REWARDS = {"grpo-0": 0.0, "grpo-1": 0.5, "grpo-2": 1.0, "ep-cc": 1.0}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Iterator[tuple[Path, list[dict]]]:
    """The record dir, and the control API's list of its sessions once all were closed."""
    import anthropic

    chromium_binary()  # skip (or fail, in CI) before recording anything
    config = ReplicaConfig(
        tokenizer=tokenizer_path("qwen3"),
        preferred_tools={"Agent": {"description": "List files", "prompt": SUBAGENT_PROMPT}},
    )
    record_dir = tmp_path_factory.mktemp("rec")
    cwd = tmp_path_factory.mktemp("proxy")
    with ReplicaThread(config) as replica:
        with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=cwd,
                      options={"tito_control_token": TOKEN}) as proxy:  # fmt: skip
            api = anthropic.Anthropic(base_url=proxy.url, api_key="sk-ant-x", max_retries=0,
                                      default_headers={"x-session-id": "ep-cc"})  # fmt: skip
            claude_code_episode(api)
            for session in ("grpo-0", "grpo-1", "grpo-2"):
                run_agent(agent(proxy, session), 2, first="Weather in Oslo?")
            tree = agent(proxy, "tree-1")
            run_agent(tree, 2, first="Weather in Rome?")
            run_agent(tree, 3, first="Weather in Rome?")  # samples its first turn's answer again: a branch
            with TitoClient(proxy.url, TOKEN) as tito:
                for session, reward in REWARDS.items():
                    group = GROUP if session.startswith("grpo") else None
                    tito.annotate(session, reward=reward, labels=["graded"], **({"group": group} if group else {}))
                tito.annotate("tree-1", labels=[HOSTILE])  # a label is any text a driver sends
                for session in [*REWARDS, "tree-1"]:
                    tito.close(session)
                listed = tito.sessions()
    yield record_dir, listed


@pytest.fixture(scope="module")
def view_server(recorded) -> Iterator[str]:
    record_dir, _ = recorded
    with running_view(record_dir) as url:
        yield url


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[HeadlessChromium]:
    with HeadlessChromium(tmp_path_factory.mktemp("chromium")) as running:
        yield running


@pytest.fixture
def page(browser) -> Iterator[Page]:
    opened = browser.new_page(width=1400, height=1000)
    yield opened
    opened.close()


def redrawn(page: Page, action) -> None:
    """Do `action` (a click, a filter) and wait until the page has drawn the address it leads to."""
    page.evaluate("document.body.dataset.ready = 'pending'")
    action()
    page.wait_for("document.body.dataset.ready && document.body.dataset.ready !== 'pending'", timeout=20)


def export_rows(record_dir: Path, tmp_path: Path) -> list[dict]:
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), "--to", "jsonl"],
                   cwd=REPO, check=True, capture_output=True)  # fmt: skip
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_the_rollout_table_lists_filters_and_sorts_the_episodes(recorded, view_server, browser, page, tmp_path) -> None:
    record_dir, _ = recorded
    files = list(iter_session_files(record_dir))
    first_ts = {f.turns[0].episode_id: min(t.ts for t in f.turns) for f in files}
    shown(page, view_server + "/#/")
    assert texts(page, "#episodes tbody tr", "data-episode") == sorted(first_ts, key=first_ts.get)
    assert texts(page, "#counts")[0].startswith(
        f"5 of 5 episodes match · 5 sessions · {sum(len(f.turns) for f in files)} turns"
    )
    rewards = dict(
        zip(texts(page, "#episodes tbody tr", "data-episode"), texts(page, "#episodes td.reward"), strict=True)
    )
    assert rewards == {**{e: f"{r:.3f}" for e, r in REWARDS.items()}, "tree-1": "–"}
    png = screenshot(page, "browser-episodes.png", tmp_path)
    assert browser.image_facts(png, {"main pill": (0x09, 0x69, 0xDA)}).near["main pill"] > 200
    # A filter typed into the form, then a column header clicked twice: high rewards first; equal ones by name.
    redrawn(page, lambda: page.set_value("#filters input[name=reward_min]", "0.5"))
    assert texts(page, "#episodes tbody tr", "data-episode") == ["ep-cc", "grpo-1", "grpo-2"]
    redrawn(page, lambda: page.click("#episodes th[data-sort=reward]"))
    redrawn(page, lambda: page.click("#episodes th[data-sort=reward]"))
    assert texts(page, "#episodes tbody tr", "data-episode") == ["grpo-2", "ep-cc", "grpo-1"]
    redrawn(page, lambda: page.set_value("#filters select[name=call]", "subagent"))
    assert texts(page, "#episodes tbody tr", "data-episode") == ["ep-cc"]
    shown(page, view_server + f"/#/?group={GROUP}&sort=length&order=desc")
    lengths = [int(text) for text in texts(page, "#episodes td.length")]
    assert len(lengths) == 3 and lengths == sorted(lengths, reverse=True)


def test_the_sessions_table_is_the_control_apis_list(recorded, view_server, page) -> None:
    _, listed = recorded
    shown(page, view_server + "/#/sessions")
    rows = page.evaluate("""[...document.querySelectorAll('#sessions tbody tr')].map(tr =>
        [tr.dataset.session, ...[...tr.querySelectorAll('td.num')].slice(0, 3).map(td => Number(td.textContent))])""")
    assert rows == [[row["session_id"], row["turns"], row["tokens"], row["branches"]] for row in listed]
    assert len(rows) == 5


def test_an_episode_is_drawn_with_its_compaction_and_sub_agent(recorded, view_server, browser, page, tmp_path) -> None:
    record_dir, _ = recorded
    rows = [row for row in export_rows(record_dir, tmp_path) if row["episode"] == "ep-cc"]
    shown(page, view_server + "/#/episode/ep-cc")
    drawn = page.evaluate(
        "[...document.querySelectorAll('#segment-graph g.segment')].map(g => [Number(g.dataset.index), g.dataset.call])"
    )
    assert drawn == [[row["segment"], row["call"]] for row in rows]
    assert [c for _, c in drawn] == ["main", "compaction", "main", "subagent", "side"]
    links = page.evaluate(
        "[...document.querySelectorAll('#segment-graph path.link')]"
        ".map(p => [p.dataset.kind, Number(p.dataset.from), Number(p.dataset.to)])"
    )
    # The compaction extends the main run's turn 2; the rebuilt context follows the summary; the sub-agent follows
    # the turn whose tool call spawned it.
    assert sorted(links) == [["extends", 0, 1], ["follows", 1, 2], ["follows", 2, 3]]
    said = texts(page, "#links li")
    assert any("follows session ep-cc turn 4 (by summary" in s for s in said)
    assert any("follows session ep-cc turn 5 (by tool_argument, tool call" in s for s in said)
    session = read_session(record_dir, "ep-cc")
    assert session is not None
    nodes = page.evaluate("[...document.querySelectorAll('.tree g.tree-node')].map(g => Number(g.dataset.turn))")
    assert sorted(nodes) == [t.turn_id for t in session.turns]
    png = screenshot(page, "browser-episode.png", tmp_path)
    colours = {"compaction": (0xBF, 0x87, 0x00), "subagent": (0x82, 0x50, 0xDF), "follows": (0xCF, 0x22, 0x2E)}
    seen = browser.image_facts(png, colours).near
    assert all(count > 50 for count in seen.values()), seen
    # A segment box leads to its first turn.
    redrawn(page, lambda: page.click("#segment-graph g.segment[data-call=subagent]"))
    assert page.evaluate("location.hash") == "#/turn/ep-cc/6"


def test_a_turns_tokens_and_shades_are_the_record(recorded, view_server, browser, page, tmp_path) -> None:
    record_dir, _ = recorded
    session = read_session(record_dir, "ep-cc")
    assert session is not None
    turn = next(t for t in session.turns if t.turn_id == 5)
    shown(page, view_server + "/#/turn/ep-cc/5")
    tokens = page.evaluate("""[...document.querySelectorAll('#tokens .tok')].map(s => ({id: Number(s.dataset.id),
        sampled: s.classList.contains('sampled'), special: s.classList.contains('special'), text: s.textContent,
        logprob: s.dataset.logprob === undefined ? null : Number(s.dataset.logprob),
        style: s.getAttribute('style')}))""")
    assert [t["id"] for t in tokens] == turn.prompt_added_ids + turn.completion_ids
    sampled = [t for t in tokens if t["sampled"]]
    assert [t["logprob"] for t in sampled] == turn.completion_logprobs
    for token in sampled:
        alpha = float(re.search(r"rgba\(255, 196, 0, ([0-9.]+)\)", token["style"]).group(1))
        assert alpha == pytest.approx(0.15 + 0.75 * (1 - math.exp(token["logprob"])), abs=1e-3)
    special = {t["text"] for t in tokens if t["special"]}
    assert {"<|im_start|>", "<|im_end|>"} <= special
    facts = texts(page, "#turn-facts")[0]
    assert "episode ep-cc" in facts and "follows session ep-cc turn 4" in facts and "segment 2 (from turn 5)" in facts
    assert turn.assistant_message["tool_calls"][0]["function"]["name"] in page.evaluate(
        "document.querySelector('.messages').textContent"
    )
    # On screen, the sampled tokens' backgrounds are their shades: each blended over white, as the record's
    # log-probs make them.
    page.evaluate("document.querySelector('#tokens .tok.sampled').scrollIntoView({block: 'start'})")
    png = screenshot(page, "browser-turn.png", tmp_path)
    alphas = sorted({round(0.15 + 0.75 * (1 - math.exp(lp)), 3) for lp in turn.completion_logprobs})
    blends = {str(a): (255, round(255 - 59 * a), round(255 * (1 - a))) for a in alphas[-3:]}
    counts = browser.image_facts(png, blends, within=3).near
    assert sum(counts.values()) > 300, counts
    # The branch's drift audit, from the turn's link.
    href = page.evaluate("document.querySelector('.audit-link').getAttribute('href')")
    audit = get(view_server + href)
    assert audit.status_code == 200 and "tito audit: session ep-cc" in audit.text


def test_a_group_is_its_episodes_side_by_side(view_server, page, tmp_path) -> None:
    shown(page, view_server + f"/#/group/{GROUP}")
    cards = page.evaluate(
        "[...document.querySelectorAll('#group-episodes .episode-card')]"
        ".map(c => [c.dataset.episode, c.querySelector('.reward').textContent])"
    )
    assert cards == [[f"grpo-{k}", f"reward {r:.3f}"] for k, r in enumerate((0.0, 0.5, 1.0))]
    assert texts(page, "#group-facts")[0].startswith("3 episodes · mean reward 0.500 · std 0.500")
    screenshot(page, "browser-group.png", tmp_path)


def test_one_episode_as_a_file_needs_no_server(recorded, page, tmp_path) -> None:
    record_dir, _ = recorded
    out = tmp_path / "ep-cc.html"
    argv = [sys.executable, "-m", "tito_addon", "view", str(record_dir), "--html", str(out), "--episode", "ep-cc"]
    made = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "episode ep-cc, 10 turns" in made.stdout
    shown(page, out.as_uri())
    assert texts(page, "#segment-graph g.segment", "data-call") == ["main", "compaction", "main", "subagent", "side"]
    shown(page, out.as_uri() + "#/turn/ep-cc/7")
    session = read_session(record_dir, "ep-cc")
    assert session is not None
    turn = next(t for t in session.turns if t.turn_id == 7)
    assert [int(i) for i in texts(page, "#tokens .tok", "data-id")] == turn.prompt_added_ids + turn.completion_ids
    assert page.evaluate("performance.getEntriesByType('resource').length") == 0  # nothing fetched
    # A record's text is text, in the file's inlined data too: the hostile label shows as written and runs nothing.
    hostile = tmp_path / "tree-1.html"
    argv = [sys.executable, "-m", "tito_addon", "view", str(record_dir), "--html", str(hostile), "--episode", "tree-1"]
    assert subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120).returncode == 0
    assert "</script><img" not in hostile.read_text()
    shown(page, hostile.as_uri())
    assert HOSTILE in texts(page, "#episode-facts")[0]
    assert page.evaluate("document.querySelectorAll('img').length === 0 && window.pwned === undefined")


def test_a_bad_record_dir_is_said_and_nothing_outside_it_is_served(recorded, page, tmp_path) -> None:
    record_dir, _ = recorded
    bad = tmp_path / "bad"
    shutil.copytree(record_dir, bad)
    with (bad / "grpo-0.jsonl").open("ab") as handle:
        handle.write(b'{"schema": "tito.turn.v1", "session_id": "grpo-0", "turn_id": 9')  # torn mid-write
    (bad / "notes.txt").write_text("not a record")
    (bad / "nested").mkdir()
    secret = tmp_path / "outside.jsonl"
    secret.write_text('{"schema": "tito.turn.v1", "session_id": "SECRET-OUTSIDE"}\n')
    (bad / "link.jsonl").symlink_to(secret)
    (bad / "foreign.jsonl").write_text('{"hello": "world"}\n')
    with running_view(bad) as url:
        shown(page, url + "/#/")
        banner = texts(page, "#skipped")[0]
        assert "notes.txt" in banner and "nested/" in banner and "link.jsonl (not a regular file" in banner
        assert "grpo-0.jsonl: 1 unreadable line(s) skipped" in banner and "foreign.jsonl: 1 unreadable" in banner
        assert len(texts(page, "#episodes tbody tr")) == 5  # the readable ones, all still there
        tries = [
            "/api/turn?session=../outside&turn=0", "/api/turn?session=link&turn=0", "/api/episode?id=../outside",
            "/api/turn?session=grpo-0&turn=../../x", "/audit?session=..%2Foutside&leaf=0", "/..%2Foutside.jsonl",
            "/%2e%2e/outside.jsonl", "/api/group?id=../../outside", "/api/turn?session=SECRET-OUTSIDE&turn=0",
        ]  # fmt: skip
        for path in tries:
            answer = get(url + path)
            assert 400 <= answer.status_code < 500, (path, answer.status_code)
            assert answer.json()["error"]["message"] and "hello" not in answer.text
        for path in ("/api/episodes", "/api/sessions"):
            assert "SECRET-OUTSIDE" not in get(url + path).text
        assert get(url + "/api/episodes?reward_min=abc").status_code == 400
        assert get(url + "/api/episodes?sort=__class__").status_code == 400


def test_a_sessions_branches_are_drawn_as_its_tree(recorded, view_server, page) -> None:
    record_dir, _ = recorded
    session = read_session(record_dir, "tree-1")
    assert session is not None
    shown(page, view_server + "/#/episode/tree-1")
    nodes = page.evaluate("""[...document.querySelectorAll('.tree g.tree-node')].map(g =>
        [Number(g.dataset.turn), g.classList.contains('sibling')])""")
    # Siblings: turns of one parent, or roots of one first prompt (the second run asks the first question again).
    full = session.full_ids()
    points = {
        t.turn_id: t.parent_turn_id if t.parent_turn_id is not None else str(full[t.turn_id][0]) for t in session.turns
    }
    ringed = {turn for turn, point in points.items() if list(points.values()).count(point) > 1}
    assert ringed, "the second run samples the first turn again: a branch"
    assert sorted(nodes) == sorted([t.turn_id, t.turn_id in ringed] for t in session.turns)
    # Each edge drawn runs from a parent's place to its child's.
    edges = page.evaluate("document.querySelectorAll('.tree path.tree-edge').length")
    assert edges == sum(1 for t in session.turns if t.parent_turn_id is not None)
