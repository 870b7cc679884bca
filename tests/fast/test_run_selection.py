"""A run's worth of sessions, looked at and exported as a run: export selects by id prefix and by a sessions file (the
same bytes as naming each `--session`), an empty selection is refused, a group-size error names the sessions to look
at, verl_batch's length errors say the lengths to set, `show` reads as a person needs (tool calls with arguments, the
results that answered them, the episode's reward, group and labels; `--full` whole), and `audit` takes `--session`
and marks turns and the reward on its page. On sessions recorded from the real qwen3 tokenizer and the sglang
replica (`support.recorded_sessions.record_episodes`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
from support.basics import REPO
from support.recorded_run import EPISODES, record_run
from support.recorded_sessions import record_episodes

from tito_addon.records.record_reader import read_session
from tito_addon.records.rollout_groups import GroupSizeError, arrange
from tito_addon.records.segment_branches import branches
from tito_addon.records.session_selection import recorded_session_ids
from tito_addon.trainers.verl_batch import verl_batch


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    return record_run(tmp_path_factory.mktemp("run"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tito_addon", *args], cwd=REPO, capture_output=True, text=True)


def export(record_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return cli("export", str(record_dir), str(out), "--format", "verl", "--group-size", "2", *args)


def test_export_by_prefix_and_by_file_is_export_by_the_same_session_list(record_dir: Path, tmp_path: Path) -> None:
    run = sorted(s for s in EPISODES if s.startswith("run7-"))  # a prefix's matches come in id order
    named = export(record_dir, tmp_path / "named.parquet", *[a for s in run for a in ("--session", s)])
    assert named.returncode == 0, named.stderr
    assert "4 segments from 4 sessions" in named.stdout
    by_prefix = export(record_dir, tmp_path / "prefix.parquet", "--session-prefix", "run7-")
    assert by_prefix.returncode == 0, by_prefix.stderr
    listed = tmp_path / "sessions.txt"
    listed.write_text("# run 7, as the driver listed it\n\n" + "\n".join(f"  {s}" for s in run) + "\n")
    by_file = export(record_dir, tmp_path / "file.parquet", "--sessions-file", str(listed))
    assert by_file.returncode == 0, by_file.stderr
    data = (tmp_path / "named.parquet").read_bytes()
    assert (tmp_path / "prefix.parquet").read_bytes() == data and (tmp_path / "file.parquet").read_bytes() == data
    # Both at once: the file's ids first, then the prefix's others, each once.
    listed.write_text("run7-a0\nrun7-a1\n")
    mixed = export(record_dir, tmp_path / "mixed.parquet", "--sessions-file", str(listed), "--session-prefix", "run7-b")
    assert mixed.returncode == 0 and (tmp_path / "mixed.parquet").read_bytes() == data, mixed.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--session-prefix", "run8-"], "no recorded session's id starts with 'run8-'"),
        (["--session-prefix", ""], "a session prefix must not be empty"),
        (["--sessions-file", "{empty}"], "names no session"),
        (["--sessions-file", "{missing}"], "cannot read the sessions file"),
        (["--session-prefix", "run7-", "--session", "run7-zz"], "no session 'run7-zz'"),
    ],
)
def test_an_empty_or_unknown_selection_is_refused_and_writes_nothing(
    record_dir: Path, tmp_path: Path, args: list[str], said: str
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    out = tmp_path / "rows.parquet"
    result = cli("export", str(record_dir), str(out),
                 *[a.format(empty=empty, missing=tmp_path / "nope.txt") for a in args])  # fmt: skip
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert not out.exists() and "Traceback" not in result.stderr


def test_a_group_size_error_names_the_sessions_of_the_group(record_dir: Path, tmp_path: Path) -> None:
    result = export(record_dir, tmp_path / "rows.parquet")  # every session: the stray one is a group of one
    assert result.returncode == 2
    assert "has 1 rows (1 episodes; sessions: stray-1)" in result.stderr, result.stderr
    assert "fewer than the group size 2" in result.stderr
    # Padding needs rewards: the stray session has none, and is named.
    padded = export(record_dir, tmp_path / "rows.parquet", "--group-policy", "pad", "--group-size", "3")
    assert padded.returncode == 2 and "no reward (sessions: stray-1)" in padded.stderr, padded.stderr


def test_a_huge_groups_error_names_a_bounded_few(record_dir: Path) -> None:
    files = [read_session(record_dir, s) for s in ("run7-a0", "run7-a1")]
    rows = branches(files) * 60  # 120 rows of one group, as if 120 sessions
    with pytest.raises(GroupSizeError) as refused:
        arrange(rows, group_size=8)
    message = str(refused.value)
    assert "sessions: run7-a0, run7-a1" in message and len(message) < 600


def test_recorded_ids_are_read_from_names_and_digest_files(tmp_path: Path) -> None:
    odd = "run7/odd id"  # not a safe file name: recorded under a digest, its id read from its first line
    record_episodes(tmp_path, {odd: ("Weather in Paris?", None, 1.0), "run7-plain": ("Weather in Lima?", None, 0.5)})
    assert recorded_session_ids(tmp_path) == ["run7-plain", odd]
    result = cli("show", str(tmp_path), "--session-prefix", "run7/")
    assert result.returncode == 0 and f"session {odd} " in result.stdout and "run7-plain" not in result.stdout


def test_verl_batch_length_errors_name_the_longest_prompt_and_response(record_dir: Path, tmp_path: Path) -> None:
    """Checked before torch is imported, so this runs where torch is not (the addon's own environment)."""
    out = tmp_path / "rows.jsonl"
    assert cli("export", str(record_dir), str(out), "--format", "verl", "--to", "jsonl").returncode == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prompt = max(rows, key=lambda r: len(r["prompts"]))
    response = max(rows, key=lambda r: len(r["responses"]))
    shortest = min(len(r["prompts"]) for r in rows)
    assert len(prompt["prompts"]) > shortest, "the rows differ in prompt length"
    with pytest.raises(ValueError) as refused:
        verl_batch(out, prompt_length=shortest)
    message = str(refused.value)
    assert f"the longest prompt is {len(prompt['prompts'])} tokens (row {prompt['index']}, episode " \
           f"{prompt['episode']!r}" in message, message  # fmt: skip
    assert f"the longest response {len(response['responses'])} (row {response['index']}" in message
    with pytest.raises(ValueError, match=f"longest prompt is {len(prompt['prompts'])} tokens"):
        verl_batch(out, prompt_length=1, prompt_overflow="drop")  # every row left out


def test_show_reads_as_a_person_needs(record_dir: Path) -> None:
    session = read_session(record_dir, "run7-a0")
    assert session is not None
    (call,) = session.turns[0].assistant_message["tool_calls"]
    arguments = call["function"]["arguments"]
    (answer,) = [m for m in session.turns[1].appended_messages or [] if m.get("role") == "tool"]
    result = cli("show", str(record_dir), "--session", "run7-a0", "--width", "200")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.splitlines()[0] == "session run7-a0 (run7-a0.jsonl): 2 turns"
    # The episode as the export sees it: latest reward, its group, labels in the order written, metadata keys.
    assert "episode run7-a0: reward 1, group paris, labels scored, checked, metadata keys seed, open" in out
    assert "segment 0: main, turns 0-1" in out
    # The call with its arguments, the result that answered it under it, the turn-level note on its turn.
    assert f"→ {call['function']['name']}({arguments})" in out
    assert f"← {answer['content']}" in out
    assert "[reasoning " in out and 'note: labels checked, metadata {"seed": 3}' in out


def test_show_cuts_to_a_width_and_full_shows_everything(record_dir: Path) -> None:
    session = read_session(record_dir, "run7-a0")
    assert session is not None
    text = session.turns[1].assistant_message["content"].strip()
    assert len(text) > 60
    cut = cli("show", str(record_dir), "--session", "run7-a0", "--width", "60")
    assert cut.returncode == 0 and all(len(line) <= 60 for line in cut.stdout.splitlines()), cut.stdout
    assert text not in cut.stdout and "…" in cut.stdout
    full = cli("show", str(record_dir), "--session", "run7-a0", "--width", "60", "--full")
    assert full.returncode == 0 and text.replace("\n", "\n        ") in full.stdout, full.stdout


def test_show_json_carries_each_turns_annotations(record_dir: Path) -> None:
    result = cli("show", str(record_dir), "--session", "run7-a0", "--json")
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["turn_id"] for r in rows] == [0, 1]
    assert rows[0]["annotations"] == [] and rows[1]["annotations"][0]["labels"] == ["checked"]


def test_show_stays_fast_on_a_thousand_turn_session(tmp_path: Path) -> None:
    """1000 turns with a 40 000-token context: show reads lengths, never each turn's rebuilt prompt."""
    tokenizer = {"name": "t", "tokenizer_sha256": "x", "template_sha256": "y", "family": "qwen3"}
    lines, end = [], 0
    for turn_id in range(1000):
        added = list(range(40_000)) if turn_id == 0 else [7] * 30
        call = {"id": f"c{turn_id}", "type": "function", "function": {"name": "run", "arguments": '{"cmd": "ls"}'}}
        appended = [{"role": "user", "content": "go"}] if turn_id == 0 else [
            {"role": "tool", "tool_call_id": f"c{turn_id - 1}", "content": f"result {turn_id - 1} " + "x" * 5000}
        ]  # fmt: skip
        lines.append(json.dumps({
            "schema": "tito.turn.v1", "session_id": "long", "turn_id": turn_id,
            "parent_turn_id": turn_id - 1 if turn_id else None, "ts": 1.0 + turn_id, "model": "m",
            "backend_kind": "sglang", "sampling": {}, "chat_template_kwargs": {}, "tools_sha256": None,
            "appended_messages": appended, "prompt_added_ids": added,
            "prompt_segments": [{"source": "boundary", "start": 0, "end": len(added)}],
            "prompt_len": end + len(added), "completion_ids": [5] * 20, "completion_logprobs": [-0.5] * 20,
            "assistant_message": {"role": "assistant", "content": "", "reasoning_content": "r" * 3000,
                                  "tool_calls": [call]},
            "finish_reason": "tool_calls", "tokenizer": tokenizer,
        }))  # fmt: skip
        end += len(added) + 20
    (tmp_path / "long.jsonl").write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    result = cli("show", str(tmp_path), "--width", "100")
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert sum(line.startswith("  turn ") for line in out) == 1000 and max(map(len, out)) <= 100
    assert "        ← result 998 xxx" in result.stdout and "[reasoning 3000 chars] rrr" in result.stdout
    assert took < 10, took  # the whole process (about half a second here)


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.turns: list[dict[str, str]] = []
        self.tokens = 0
        self.episode = ""
        self._in_episode = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        values = {k: v or "" for k, v in attrs}
        classes = values.get("class", "").split()
        if "turn-start" in classes:
            self.turns.append({**values, "at": str(self.tokens)})
        if "tok" in classes:
            self.tokens += 1
        self._in_episode = values.get("id") == "episode"

    def handle_data(self, data: str) -> None:
        if self._in_episode:
            self.episode += data

    def handle_endtag(self, tag: str) -> None:
        self._in_episode = False


def test_audit_takes_sessions_and_its_page_marks_turns_and_the_reward(record_dir: Path, tmp_path: Path) -> None:
    report = tmp_path / "audit.json"
    page = tmp_path / "page.html"
    result = cli("audit", str(record_dir), "--session", "run7-a0", "--session", "run7-b1", "--json", str(report),
                 "--html", str(page))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(b["session_id"] for b in json.loads(report.read_text())) == ["run7-a0", "run7-b1"]
    assert "2 branches" in result.stdout
    parsed = Page()
    parsed.feed(page.read_text())
    session = read_session(record_dir, "run7-a0")
    assert session is not None
    # A marker at each turn's first added id, naming the turn and its call.
    starts = [str(t.prompt_len - len(t.prompt_added_ids)) for t in session.turns]
    assert [(m["data-turn"], m["data-call"], m["at"]) for m in parsed.turns] == [
        (str(t.turn_id), t.call, at) for t, at in zip(session.turns, starts, strict=True)
    ]
    assert parsed.episode == "episode run7-a0: reward 1, group paris, labels scored, checked"
    unknown = cli("audit", str(record_dir), "--session", "run9")
    assert unknown.returncode == 2 and "no session 'run9'" in unknown.stderr


def test_make_demo_records_outside_the_exported_recordings_folder() -> None:
    """`make demo` writes where no `export recordings/` looks, and where git ignores it."""
    from tito_addon.tools.demo_run import DEMO_RECORDINGS

    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    (folder,) = [
        line.split("--record-dir", 1)[1].split()[0] for line in recipe.splitlines() if "tito_addon demo" in line
    ]
    assert REPO / folder == DEMO_RECORDINGS, "the Makefile and the demo's own default agree"
    assert not (REPO / folder).resolve().is_relative_to((REPO / "recordings").resolve())
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{folder}/demo-1.jsonl"], cwd=REPO)
    assert ignored.returncode == 0, f"{folder} is not ignored by git"
