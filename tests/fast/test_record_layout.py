"""Several writer processes, one session: each writes its own part, every reader sees one session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.proxy_harness import REPO

from tito_addon.canonical_chat import ChatMessage
from tito_addon.records import trajectory_recorder
from tito_addon.records.record_models import TurnRecord
from tito_addon.records.record_reader import (
    RecordError,
    iter_session_files,
    read_session,
    read_session_file,
    session_parts,
)
from tito_addon.records.replay_index import ReplayIndex
from tito_addon.records.trajectory_recorder import (
    WRITER_ID,
    TrajectoryRecorder,
    default_writer_id,
    session_file_name,
)

# turn id -> (parent, prompt ids added, completion ids); a tree with a branch at turn 0 and one at turn 2.
TREE: dict[int, tuple[int | None, list[int], list[int]]] = {
    0: (None, [1, 2, 3], [10, 11]),
    1: (0, [4], [12]),
    2: (1, [5, 6], [13, 14]),
    3: (0, [7], [15, 16, 17]),
    4: (2, [8], [18]),
    5: (2, [9, 9], [19]),
}
# Which writer commits each turn, in commit order: parents on one writer, children on the other.
COMMITS = [(0, "a"), (1, "b"), (3, "b"), (2, "a"), (5, "b"), (4, "a")]


def expected_ids() -> dict[int, tuple[list[int], list[int]]]:
    out: dict[int, tuple[list[int], list[int]]] = {}
    for turn_id, (parent, added, completion) in TREE.items():
        before = out[parent][0] + out[parent][1] if parent is not None else []
        out[turn_id] = (before + added, completion)
    return out


def turn(session_id: str, turn_id: int) -> TurnRecord:
    parent, added, completion = TREE[turn_id]
    return TurnRecord.model_validate(
        {
            "schema": "tito.turn.v1", "session_id": session_id, "turn_id": turn_id, "parent_turn_id": parent,
            "ts": 1.0 + turn_id, "model": "m", "backend_kind": "sglang", "sampling": {}, "chat_template_kwargs": {},
            "tools_sha256": None, "appended_messages": [{"role": "user", "content": f"question {turn_id}"}],
            "prompt_added_ids": added, "prompt_segments": [], "prompt_len": len(expected_ids()[turn_id][0]),
            "completion_ids": completion, "completion_logprobs": [-0.5] * len(completion),
            "assistant_message": {"role": "assistant", "content": f"answer {turn_id}"}, "finish_reason": "stop",
            "tokenizer": {"name": "t", "tokenizer_sha256": "x", "template_sha256": "y", "family": "qwen3"},
        }
    )  # fmt: skip


def record(record_dir: Path, session_id: str) -> dict[str, TrajectoryRecorder]:
    writers = {name: TrajectoryRecorder(record_dir, writer=f"host-{name}-{100 + i}") for i, name in enumerate("abc")}
    for turn_id, name in COMMITS:
        writers[name].write_turn(turn(session_id, turn_id))
    writers["c"].close_session(session_id, turns=len(TREE), reason="shutdown")  # a writer with no turns closes it
    return writers


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tito_addon", *args], cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("session_id", ["agent-7", "team/run 7: ü"])
def test_two_writers_parts_read_back_as_one_session(tmp_path: Path, session_id: str) -> None:
    writers = record(tmp_path, session_id)
    name = session_file_name(session_id)
    parts = {w: writers[w].path_for(session_id) for w in "abc"}
    assert {p.name for p in parts.values()} == {name[: -len(".jsonl")] + f"+host-{w}-{100 + i}.jsonl"
                                                for i, w in enumerate("abc")}  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in parts.values())
    # Each part holds only its writer's lines, in its commit order.
    assert [t.turn_id for t in read_session_file(parts["a"]).turns] == [0, 2, 4]
    assert [t.turn_id for t in read_session_file(parts["b"]).turns] == [1, 3, 5]

    assert session_parts(tmp_path) == {name: sorted(parts.values())}
    for session in (read_session(tmp_path, session_id), *iter_session_files(tmp_path)):
        assert session is not None and sorted(session.paths) == sorted(parts.values())
        assert [t.turn_id for t in session.turns] == [0, 1, 2, 3, 4, 5]
        position = {t.turn_id: i for i, t in enumerate(session.turns)}
        assert all(position[t.parent_turn_id] < position[t.turn_id] for t in session.turns if t.parent_turn_id)
        assert session.full_ids() == expected_ids()
        assert [c.reason for c in session.closes] == ["shutdown"] and session.skipped_lines == []
        assert sorted(t.turn_id for leaf in session.branches() for t in leaf[-1:]) == [3, 4, 5]
    assert len(list(iter_session_files(tmp_path))) == 1
    assert read_session(tmp_path, session_id + "-other") is None
    assert read_session(tmp_path / "missing", session_id) is None


def test_a_writerless_file_and_writer_parts_are_one_session(tmp_path: Path) -> None:
    plain, part = TrajectoryRecorder(tmp_path), TrajectoryRecorder(tmp_path, writer="w1")
    assert plain.path_for("s") == tmp_path / "s.jsonl" and part.path_for("s") == tmp_path / "s+w1.jsonl"
    for turn_id, name in COMMITS:
        (plain if name == "a" else part).write_turn(turn("s", turn_id))
    TrajectoryRecorder(tmp_path, writer="w0").write_turn(turn("other", 0))
    assert session_parts(tmp_path) == {
        "other.jsonl": [tmp_path / "other+w0.jsonl"],
        "s.jsonl": [tmp_path / "s.jsonl", tmp_path / "s+w1.jsonl"],  # the writer-less file first
    }
    session = read_session(tmp_path, "s")
    assert session is not None and session.path == tmp_path / "s.jsonl" and session.full_ids() == expected_ids()
    assert [f.turns[0].session_id for f in iter_session_files(tmp_path)] == ["other", "s"]


def test_a_torn_line_in_one_part_is_skipped_and_counted(tmp_path: Path) -> None:
    writers = record(tmp_path, "s")
    torn = writers["b"].path_for("s")
    with torn.open("ab") as handle:  # a crash mid-write: half a line, no newline
        handle.write(turn("s", 5).dump_line()[:50])
    writers["b"].close_session("s", turns=3, reason="idle")  # the next line of that writer stays whole
    session = read_session(tmp_path, "s")
    assert session is not None
    assert session.skipped == [(torn, 4)] and session.skipped_lines == [4]
    assert session.full_ids() == expected_ids()
    assert [c.reason for c in session.closes] == ["shutdown", "idle"]  # by time: the later close last
    result = cli("show", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{torn}: skipping unreadable line 4" in result.stderr
    assert len(result.stdout.splitlines()) == len(TREE)


def test_a_turn_id_in_two_parts_is_a_record_error(tmp_path: Path) -> None:
    writers = record(tmp_path, "s")
    writers["c"].write_turn(turn("s", 2))  # a second writer claims turn 2
    with pytest.raises(RecordError, match=r"turn id 2 appears in both .*\+host-a-100\.jsonl and .*\+host-c-102"):
        read_session(tmp_path, "s")
    with pytest.raises(RecordError, match="turn id 2 appears in both"):
        list(iter_session_files(tmp_path))
    result = cli("show", str(tmp_path))
    assert result.returncode == 2 and "turn id 2 appears in both" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_parent_names_every_part(tmp_path: Path) -> None:
    TrajectoryRecorder(tmp_path, writer="w1").write_turn(turn("s", 0))
    TrajectoryRecorder(tmp_path, writer="w2").write_turn(turn("s", 2))  # its parent, turn 1, was never written
    session = read_session(tmp_path, "s")
    assert session is not None
    with pytest.raises(RecordError, match=r"s\+w1\.jsonl \(and 1 more part\): turn 2 extends turn 1"):
        session.full_ids()


@pytest.mark.parametrize("writer", ["", "a/b", "..", ".", "a+b", "a.b", "-a", "_a", "a b", "a\x00", "x" * 65, "é"])
def test_a_writer_id_that_could_escape_or_confuse_the_layout_is_refused(tmp_path: Path, writer: str) -> None:
    with pytest.raises(ValueError, match="writer id"):
        TrajectoryRecorder(tmp_path, writer=writer)
    assert not list(tmp_path.iterdir())


def test_default_writer_ids_are_valid_and_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = {default_writer_id() for _ in range(20)}
    assert len(ids) == 20 and all(WRITER_ID.fullmatch(w) for w in ids)
    assert all(f"-{os.getpid()}-" in w for w in ids)
    for host in ["../../etc", "node 1.cluster.local", "+", "", "ü" * 80, "a" * 200]:
        monkeypatch.setattr("socket.gethostname", lambda host=host: host)
        writer = default_writer_id()
        assert WRITER_ID.fullmatch(writer) and "." not in writer and "/" not in writer, writer
    monkeypatch.setattr("socket.gethostname", lambda: "node-1.cluster.local")
    assert default_writer_id().startswith(f"node-1-cluster-local-{os.getpid()}-")


def test_the_cli_shows_and_exports_one_session_from_both_writers(tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"
    record(record_dir, "agent-7")
    result = cli("show", str(record_dir), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["turn_id"] for r in rows] == [0, 1, 2, 3, 4, 5] and {r["session_id"] for r in rows} == {"agent-7"}
    assert {r["turn_id"]: (r["prompt_ids"], r["completion_ids"]) for r in rows} == expected_ids()
    result = cli("show", str(record_dir))
    assert result.returncode == 0 and "6 turns, closed (shutdown)" in result.stdout
    assert "and 2 more parts" in result.stdout

    out = tmp_path / "out.parquet"
    result = cli("export", str(record_dir), str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3 segments from 1 sessions" in result.stdout
    import pyarrow.parquet as pq

    exported = pq.read_table(out).to_pylist()
    assert {r["session_id"] for r in exported} == {"agent-7"}
    assert sorted(r["turn_ids"] for r in exported) == [[0, 1, 2, 4], [0, 1, 2, 5], [0, 3]]
    ids = expected_ids()
    for row in exported:
        leaf = row["leaf_turn_id"]
        assert row["input_ids"] == ids[leaf][0] + ids[leaf][1]


def test_show_takes_whole_session_ids_one_record_file_and_prints_whole_ids(tmp_path: Path) -> None:
    long_id = "rollout-2026-12-02-episode-000042/sample-7"  # longer than any column would hold
    record(tmp_path, long_id)
    record(tmp_path, "agent-7")
    result = cli("show", str(tmp_path), "--session", long_id, "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["session_id"] for r in rows} == {long_id} and len(rows) == len(TREE)
    assert {r["turn_id"]: (r["prompt_ids"], r["completion_ids"]) for r in rows} == expected_ids()
    # The summary names each session by its whole id, which --session takes back as it is printed.
    result = cli("show", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"session {long_id} (" in result.stdout and "session agent-7 (" in result.stdout
    # One record file: its session, every writer's part merged (the part alone lacks its turns' parents).
    part = sorted(tmp_path.glob(session_file_name(long_id)[: -len(".jsonl")] + "+*.jsonl"))[1]
    result = cli("show", str(part), "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["session_id"] for r in rows} == {long_id} and [r["turn_id"] for r in rows] == sorted(TREE)
    # What cannot be shown is a clear error, not an empty listing.
    for args, error in [
        (("--session", long_id[:16]), f"no session {long_id[:16]!r}"),
        (("--session", "agent-7", "--session", "nope"), "no session 'nope'"),
    ]:
        result = cli("show", str(tmp_path), *args)
        assert result.returncode == 2 and error in result.stderr and "Traceback" not in result.stderr, result.stderr
    result = cli("show", str(part), "--session", "agent-7")
    assert result.returncode == 2 and "a record file is already one session" in result.stderr


def test_help_lists_every_subcommand_and_mitmdumps_own_options_stay_reachable() -> None:
    from tito_addon.tools.cli import SUBCOMMANDS

    result = cli("--help")
    assert result.returncode == 0, result.stderr[-2000:]
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert set(SUBCOMMANDS) <= listed and {"--mitmdump-help", "--options"} <= listed
    for name, (summary, _) in SUBCOMMANDS.items():
        assert f"  {name} " in result.stdout and summary in result.stdout
    mitmdump = cli("--mitmdump-help")
    assert mitmdump.returncode == 0 and "--mode" in mitmdump.stdout and "--set" in mitmdump.stdout
    for name in ("show", "export", "replay", "verify-template"):
        own = cli(name, "--help")
        assert own.returncode == 0 and "usage: python -m tito_addon " + name in own.stdout, (name, own.stderr)


def test_replay_answers_a_turn_whose_parent_another_writer_recorded(tmp_path: Path) -> None:
    record(tmp_path, "agent-7")
    index = ReplayIndex.load(tmp_path)
    assert index.turns == len(TREE)
    # Turn 2 (writer a) extends turn 1 (writer b), which extends turn 0 (writer a).
    history = []
    for turn_id in (0, 1):
        history += [{"role": "user", "content": f"question {turn_id}"}]
        history += [{"role": "assistant", "content": f"answer {turn_id}"}]
    messages = [ChatMessage.model_validate(m) for m in [*history, {"role": "user", "content": "question 2"}]]
    answer = index.answer(messages)
    assert isinstance(answer, TurnRecord), answer
    assert (answer.session_id, answer.turn_id, answer.parent_turn_id) == ("agent-7", 2, 1)
    # Turn 1 itself, whose parent is in the other part.
    answer = index.answer(messages[:3])
    assert isinstance(answer, TurnRecord) and answer.turn_id == 1


def test_a_withdrawn_turn_is_left_out_but_its_id_stays_used(tmp_path: Path) -> None:
    """A turn whose commit to the shared store failed is withdrawn by a later line of its writer: readers leave it
    out (the agent got an error, not it), and its id is never handed out again."""
    writers = record(tmp_path, "s")
    leaf = max(TREE)  # a leaf: nothing extends it
    extra = turn("s", leaf)
    extra.turn_id = leaf + 10
    writers["a"].write_turn(extra)
    writers["a"].withdraw_turn("s", leaf + 10, "its commit to the session store failed")
    session = read_session(tmp_path, "s")
    assert session is not None and [t.turn_id for t in session.turns] == sorted(TREE)
    assert session.full_ids() == expected_ids() and session.skipped == []
    assert session.highest_turn_id == leaf + 10
    result = cli("show", str(tmp_path), "--json")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == len(TREE), result.stderr[-2000:]


def test_annotations_are_read_from_every_part_and_change_no_trajectory(tmp_path: Path) -> None:
    """A driver's annotation lines (in any writer's part, after the close line too) are read as annotations, in
    time order; the turns, their ids, resume's next id and replay are as without them, and no line is skipped."""
    from tito_addon.records.episode_segments import episode_segments
    from tito_addon.records.record_models import AnnotationRecord

    writers = record(tmp_path, "s")
    writers["b"].write_annotation(AnnotationRecord(session_id="s", reward=0.5, labels=["x"], ts=10.0))
    writers["a"].write_annotation(AnnotationRecord(session_id="s", turn_id=4, reward=1.0, metadata={"k": 1}, ts=11.0))
    writers["c"].write_annotation(AnnotationRecord(session_id="s", turn_id=2, labels=["y", "x"], ts=12.0))
    writers["c"].write_annotation(AnnotationRecord(session_id="s", turn_id=3, reward=0.25, scope="segment", ts=13.0))
    session = read_session(tmp_path, "s")
    assert session is not None and session.skipped == [] and session.full_ids() == expected_ids()
    assert [(a.turn_id, a.ts) for a in session.annotations] == [(None, 10.0), (4, 11.0), (2, 12.0), (3, 13.0)]
    assert session.highest_turn_id == max(TREE) and ReplayIndex.load(tmp_path).turns == len(TREE)
    notes = {segment.leaf.turn_id: segment.notes for segment in episode_segments([session])}
    # One episode: turn 4's reward reaches every segment (written after the session's), labels and metadata too;
    # turn 3's is scoped to its own segment, and wins there.
    assert (notes[4].reward, notes[4].labels, notes[4].metadata) == (1.0, ["x", "y"], {"k": 1})
    assert (notes[5].reward, notes[5].labels, notes[5].metadata) == (1.0, ["x", "y"], {"k": 1})
    assert (notes[3].reward, notes[3].labels, notes[3].metadata) == (0.25, ["x", "y"], {"k": 1})


def test_no_session_id_names_another_sessions_digest_file(tmp_path: Path) -> None:
    """`team/run-1` is recorded as `sid-<digest>.jsonl`; the id `sid-<digest>` (or `SID-…`) must name a file of its
    own, or an agent could append its turns to another session's record."""
    digested = session_file_name("team/run-1")
    alias = digested.removesuffix(".jsonl")
    for candidate in (alias, alias.upper(), "sid-x"):
        assert session_file_name(candidate) != digested and session_file_name(candidate).startswith("sid-")
    assert session_file_name("agent-7") == "agent-7.jsonl"
    TrajectoryRecorder(tmp_path).write_turn(turn("team/run-1", 0))
    TrajectoryRecorder(tmp_path).write_turn(turn(alias, 0))
    own, other = read_session(tmp_path, "team/run-1"), read_session(tmp_path, alias)
    assert own is not None and other is not None
    assert {t.session_id for t in own.turns} == {"team/run-1"} and {t.session_id for t in other.turns} == {alias}


def test_the_record_dir_is_made_when_missing_even_after_it_was_removed(tmp_path: Path) -> None:
    import shutil

    record_dir = tmp_path / "deep" / "rec"
    recorder = TrajectoryRecorder(record_dir)
    recorder.write_turn(turn("s", 0))
    shutil.rmtree(tmp_path / "deep")  # e.g. an operator clearing recordings under a running proxy
    recorder.write_turn(turn("s", 1))
    lines = (record_dir / session_file_name("s")).read_text().splitlines()
    assert [json.loads(line)["turn_id"] for line in lines] == [1]


def open_files(directory: Path) -> set[str]:
    """The files under `directory` this process holds open."""
    held = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory)):
            held.add(Path(target).name)
    return held


def test_a_held_file_removed_or_replaced_is_opened_again_and_a_renamed_one_followed(tmp_path: Path) -> None:
    """Descriptors stay open between lines: a file removed or replaced under them is opened again at its path, and
    a renamed one keeps its session whole."""
    recorder = TrajectoryRecorder(tmp_path)
    path = tmp_path / session_file_name("s")
    recorder.write_turn(turn("s", 0))
    assert open_files(tmp_path) == {path.name}
    path.unlink()
    path.write_text("")  # replaced by another file of the same name
    recorder.write_turn(turn("s", 1))
    path.rename(tmp_path / "renamed.jsonl")
    recorder.write_turn(turn("s", 2))
    assert [json.loads(line)["turn_id"] for line in (tmp_path / "renamed.jsonl").read_text().splitlines()] == [1, 2]
    assert open_files(tmp_path) == {"renamed.jsonl"}


def test_a_line_another_writer_tore_in_a_held_file_stays_its_own(tmp_path: Path) -> None:
    recorder = TrajectoryRecorder(tmp_path)
    path = tmp_path / session_file_name("s")
    recorder.write_turn(turn("s", 0))
    with path.open("ab") as other:  # a second process appending to the same file, killed mid-line
        other.write(turn("s", 1).dump_line()[:40])
    recorder.write_turn(turn("s", 2))
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[2])["turn_id"] == 2
    recorded = read_session(tmp_path, "s")
    assert recorded is not None and [t.turn_id for t in recorded.turns] == [0, 2]


def test_held_files_are_bounded_and_a_closed_session_releases_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trajectory_recorder, "OPEN_FILES", 3)
    recorder = TrajectoryRecorder(tmp_path)
    assert recorder.open_files == 3
    for name in "abcde":
        recorder.write_turn(turn(name, 0))
    assert open_files(tmp_path) == {session_file_name(name) for name in "cde"}  # the most recent ones
    recorder.close_session("d", 1, "closed")
    assert open_files(tmp_path) == {session_file_name(name) for name in "ce"}
    recorder.write_turn(turn("a", 1))  # opened again: appended after its first line
    assert [json.loads(line)["turn_id"] for line in (tmp_path / session_file_name("a")).read_text().splitlines()] == [
        0,
        1,
    ]
    recorder.close()
    assert open_files(tmp_path) == set()


def test_out_of_descriptors_the_held_files_give_theirs_back(tmp_path: Path) -> None:
    import resource

    recorder = TrajectoryRecorder(tmp_path)
    for name in "abc":
        recorder.write_turn(turn(name, 0))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    spare = []
    try:
        while True:  # take every descriptor left
            spare.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        recorder.write_turn(turn("d", 0))  # no descriptor free: the held ones are closed, then it opens
    finally:
        for fd in spare:
            os.close(fd)
    assert open_files(tmp_path) == {session_file_name("d")}
    assert TrajectoryRecorder(tmp_path).open_files == min(trajectory_recorder.OPEN_FILES, soft // 8)
