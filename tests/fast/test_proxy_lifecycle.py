"""Lifecycle through a real mitmdump: restart and resume, script hot reload, torn lines, shutdown lines."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
from support.basics import TOOLS, tokenizer_path, wait_until
from support.chat_agent import agent, run_agent
from support.proxy_harness import REPO, Mitmdump

from tito_addon.records.record_reader import read_session_file
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


@pytest.fixture(scope="module")
def replica():
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


def continue_conversation(proxy: Mitmdump, sid: str, messages: list[dict]) -> None:
    agent(proxy, sid).chat.completions.create(model="reference-model", messages=messages, tools=TOOLS)


def test_a_restarted_proxy_resumes_a_named_session_from_disk(replica, tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as first:
        messages, _ = run_agent(agent(first, "resume-me"), 3)
    path = record_dir / "resume-me.jsonl"
    assert json.loads(path.read_text().splitlines()[-1])["reason"] == "shutdown"
    # A crash left a torn line behind: it must be skipped, not merged with the next line.
    with path.open("a") as handle:
        handle.write('{"schema": "tito.turn.v1", "session_id": "resume-me", "turn_id": 3, "prompt_add')
    replica.backend.reset()
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as second:
        continue_conversation(second, "resume-me", messages)
    recorded = read_session_file(path)
    assert len(recorded.skipped_lines) == 1
    assert [t.turn_id for t in recorded.turns] == [0, 1, 2, 4]
    assert [t.parent_turn_id for t in recorded.turns] == [None, 0, 1, 2]
    ids = recorded.full_ids()
    stored = ids[2][0] + ids[2][1]
    assert ids[4][0][: len(stored)] == stored
    assert replica.received()[0]["input_ids"] == ids[4][0]


def test_hot_reload_of_the_script_keeps_serving(replica, tmp_path: Path) -> None:
    """mitmdump reloads a touched script; the reloaded addon keeps extending a named session."""
    package = tmp_path / "copy" / "tito_addon"
    package.parent.mkdir()
    import shutil

    shutil.copytree(REPO / "tito_addon", package, ignore=shutil.ignore_patterns("__pycache__"))
    record_dir = tmp_path / "rec"
    proxy = Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path)
    proxy.argv[proxy.argv.index("-s") + 1] = str(package / "__init__.py")
    with proxy:
        messages, _ = run_agent(agent(proxy, "reload"), 2)
        time.sleep(1.1)  # mtime granularity
        (package / "__init__.py").write_text((package / "__init__.py").read_text() + "\n# touched\n")
        deadline = time.monotonic() + 30
        while (
            proxy.output().count("Loading script") < 2
            or "tito: sglang backend" not in proxy.output().split("Loading script")[-1]
        ):
            assert time.monotonic() < deadline, proxy.output()[-3000:]
            time.sleep(0.2)
        continue_conversation(proxy, "reload", messages)
        assert "Traceback" not in proxy.output(), proxy.output()[-3000:]
    recorded = read_session_file(record_dir / "reload.jsonl")
    assert [t.parent_turn_id for t in recorded.turns] == [None, 0, 1]


def test_an_agent_that_hangs_up_mid_turn_cancels_it_and_nothing_is_recorded(tmp_path: Path) -> None:
    import http.client

    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), latency_s=2.0)
    record_dir = tmp_path / "rec"
    with (
        ReplicaThread(config) as slow,
        Mitmdump(slow.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy,
    ):
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        connection.request(
            "POST", "/v1/chat/completions", body, {"x-session-id": "gone", "content-type": "application/json"}
        )
        assert wait_until(lambda: len(slow.received()) == 1), "the turn reached the backend"
        connection.sock.close()  # hang up while the backend is still generating (2 s from the turn's arrival)
        time.sleep(3.0)  # past the backend's answer: whatever the proxy would record of it is on disk by now
        assert not (record_dir / "gone.jsonl").exists(), "a turn nobody received was recorded"
        assert "Traceback" not in proxy.output()


def test_the_proxy_starts_in_a_shell_without_pythonunbuffered(replica, tmp_path: Path, monkeypatch) -> None:
    """A newcomer's shell has no PYTHONUNBUFFERED: `make demo`'s mitmdump must still report its port at once, not
    hold its log in a pipe's block buffer until it exits."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    proxy = Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path)
    try:
        proxy.start(timeout=45)
        assert proxy.port is not None and proxy.proc is not None and proxy.proc.poll() is None
    finally:
        proxy.stop()


def lines_without_clock(path: Path) -> list[dict]:
    """A record's lines less what differs between two runs of the same turns: the clock and the tool-call ids the
    proxy draws at random."""
    text = re.sub(r"call_[0-9a-f]{24}", "call_X", path.read_text())
    return [{k: v for k, v in json.loads(line).items() if k != "ts"} for line in text.splitlines()]


def test_a_forked_mitmdump_records_and_exits_as_one_started_from_scratch(replica, tmp_path: Path, monkeypatch) -> None:
    """The harness forks most mitmdumps from a warmed interpreter (`mitmdump_forks`): the same turns must give the same
    record lines, the same addon log and the same exits as a mitmdump the shell starts."""
    from tito_addon.replicas.mitmdump_forks import ForkedProcess

    assert Mitmdump.forks is not None, "the test session forks its mitmdumps"
    runs = {}
    for how in ("forked", "fresh"):
        if how == "fresh":
            monkeypatch.setattr(Mitmdump, "forks", None)
        replica.backend.reset()
        record_dir = tmp_path / how
        with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as proxy:
            assert isinstance(proxy.proc, ForkedProcess) == (how == "forked")
            run_agent(agent(proxy, "same"), 3)
        assert proxy.proc is not None and proxy.proc.returncode == 0
        addon_log = [line.split("] ", 1)[-1].replace(str(record_dir), "REC") for line in proxy.output().splitlines()]
        runs[how] = (lines_without_clock(record_dir / "same.jsonl"), [line for line in addon_log if "tito" in line])
    assert runs["forked"] == runs["fresh"]
    records, log = runs["forked"]
    assert len(records) == 4 and records[-1]["reason"] == "shutdown" and any("recording to REC" in line for line in log)
    killed = Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "k", cwd=tmp_path)
    monkeypatch.undo()
    with killed:
        assert isinstance(killed.proc, ForkedProcess)
        assert killed.kill() == -9


def test_the_fork_servers_children_die_with_it_and_later_starts_are_fresh(replica, tmp_path: Path, monkeypatch) -> None:
    from tito_addon.replicas.mitmdump_forks import ForkedProcess, ForkServer

    forks = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"})
    monkeypatch.setattr(Mitmdump, "forks", forks)
    try:
        with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "a", cwd=tmp_path) as a:
            assert isinstance(a.proc, ForkedProcess)
            assert forks._server is not None
            forks._server.kill()
            assert a.proc.wait(timeout=10) == -9
            # the child itself is gone, not only reported so: it dies with its server
            assert wait_until(lambda: not Path(f"/proc/{a.proc.pid}").exists() or "Z" in status_of(a.proc.pid))
        with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "b", cwd=tmp_path) as b:
            assert not isinstance(b.proc, ForkedProcess)
            run_agent(agent(b, "after"), 1)
        assert (tmp_path / "b" / "after.jsonl").is_file()
    finally:
        forks.close()


def status_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (FileNotFoundError, IndexError):
        return "Z"
