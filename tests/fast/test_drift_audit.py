"""Drift audit: the classifier on every shared drift case of the supported families, and the audit of a recorded
session against a stock re-render (ids, not text)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.basics import SHARED, cached_tokenizer, tokenizer_path
from support.chat_agent import agent, run_agent
from support.proxy_harness import REPO, Mitmdump

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.tools.drift_audit import classify

# What each drift case is, in the audit's words.
EXPECTED = {
    "noncanonical_split_word": "bpe_resplit",
    "noncanonical_split_json": "bpe_resplit",
    "noncanonical_split_code": "bpe_resplit",
    "noncanonical_split_number": "bpe_resplit",
    "noncanonical_split_cjk": "bpe_resplit",
    "noncanonical_split_space": "bpe_resplit",
    "utf8_bytes_split": "bpe_resplit",
    "utf8_truncated_lossy": "bpe_resplit",
    "special_token_text_collision": "special_token_collision",
    "unicode_normalization": "unicode_normalization",
    "template_rerender_multiturn": "stripped_think",
    "template_rerender_reasoning_content": "stripped_think",
    "template_rerender_eos_newline": "eos_newline",
    "template_whitespace_strip": "whitespace",
    "template_kwarg_enable_thinking": "template_kwarg",
    "template_version_drift": "template_other",
    "template_tool_call_json": "tool_call_json",
    "template_tool_call_json_unicode": "tool_call_json",
    "template_tool_args_str_vs_dict": "tool_call_json",
}


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5"])
def test_every_drift_case_is_found_and_classified(family: str) -> None:
    tokenizer = cached_tokenizer(family)
    cases = [json.loads(line) for line in (SHARED / "drift_cases" / f"{family}.jsonl").read_text().splitlines()]
    assert len(cases) >= 20
    for case in cases:
        spans = classify(case["ids"], case["canonical_ids"], tokenizer)
        kinds = {span.kind for span in spans}
        assert spans, f"{case['kind']}: no drift found"
        assert EXPECTED[case["kind"]] in kinds, f"{case['kind']}: classified {kinds}"
        assert "template_other" not in kinds or case["kind"] == "template_version_drift", case["kind"]
        # Outside the spans the two sequences agree id for id.
        recorded_kept = [
            t for i, t in enumerate(case["ids"]) if not any(lo <= i < hi for s in spans for lo, hi in [s.recorded])
        ]
        canonical_kept = [
            t
            for j, t in enumerate(case["canonical_ids"])
            if not any(lo <= j < hi for s in spans for lo, hi in [s.rerendered])
        ]
        assert recorded_kept == canonical_kept, case["kind"]


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> Path:
    record_dir = tmp_path_factory.mktemp("rec")
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent
    ) as proxy:  # fmt: skip
        run_agent(agent(proxy, "audited"), 6)
    return record_dir


def test_audit_of_a_recorded_session(audited: Path, tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "audit", str(audited), "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 branches" in result.stdout
    (branch,) = json.loads(out.read_text())
    kinds = branch["kinds"]
    # The replica's non-canonical splits, the think blocks the stock Qwen3 template drops once a new user turn
    # arrives, and the newline after the last <|im_end|>: all found from the ids.
    assert kinds.get("bpe_resplit", 0) >= 1
    assert kinds.get("stripped_think", 0) >= 1
    assert kinds.get("eos_newline", 0) >= 1
    assert sum(branch["differing_tokens_per_turn"].values()) > 0
    assert set(branch["differing_tokens_per_turn"]) == {str(i) for i in range(6)}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        if os.environ.get("TITO_CHROMIUM_REQUIRED") == "1":
            pytest.fail("the audit page test needs Chromium (apt-get install chromium)")
        pytest.skip("Chromium is not installed")
    return found


def test_audit_page_renders_in_headless_chromium(audited: Path, tmp_path: Path) -> None:
    from html.parser import HTMLParser

    browser = chromium()
    page = tmp_path / "audit.html"
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "audit", str(audited), "--html", str(page)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]  # fmt: skip
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120
    ).stdout
    shot = tmp_path / "audit.png"
    subprocess.run([browser, *flags, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
                   capture_output=True, timeout=120)  # fmt: skip

    class Tokens(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tokens: list[dict[str, str]] = []
            self.inserts: list[dict[str, str]] = []
            self.turn_starts: list[str] = []

        def handle_starttag(self, tag: str, attrs: list) -> None:
            values = {k: v or "" for k, v in attrs}
            classes = values.get("class", "").split()
            if "turn-start" in classes:
                self.turn_starts.append(values["data-turn"])
            if "tok" in classes:
                self.tokens.append(values)
            if "drift-insert" in classes:
                self.inserts.append(values)

    parsed = Tokens()
    parsed.feed(dom)
    (session_file,) = list(iter_session_files(audited))
    ids = session_file.full_ids()
    leaf = session_file.turns[-1]
    prompt, completion = ids[leaf.turn_id]
    # Every token of the trajectory, in order, with its id; sampled ones exactly the recorded completions.
    assert [int(t["data-id"]) for t in parsed.tokens] == prompt + completion
    sampled = [t for t in parsed.tokens if "sampled" in t["class"].split()]
    assert len(sampled) == sum(len(t.completion_ids) for t in session_file.turns)
    assert all("background" in t["style"] for t in sampled)
    kinds = {t.get("data-kind") for t in parsed.tokens if "drift" in t["class"].split()}
    assert {"bpe_resplit", "stripped_think"} <= kinds
    assert any(i["data-kind"] == "eos_newline" for i in parsed.inserts)
    # Each turn's start marked in the rendered page, in order; the episode's head says it has no reward.
    assert [int(t) for t in parsed.turn_starts] == [t.turn_id for t in session_file.turns]
    assert '<p id="episode">episode audited: no reward, group auto-' in dom
    assert shot.exists() and shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
