"""Offline replay: a recorded 20-turn agent session served again with no backend running, to the same agent."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
from support.basics import tokenizer_path
from support.chat_agent import agent, run_agent
from support.proxy_harness import Mitmdump, post
from support.tito_commands import replay_proxy

from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread


def summary(completion) -> tuple:
    message = completion.choices[0].message
    calls = tuple((c.id, c.function.name, c.function.arguments) for c in message.tool_calls or [])
    return completion.choices[0].finish_reason, message.content, calls


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    record_dir = tmp_path_factory.mktemp("rec")
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=record_dir.parent
    ) as proxy:  # fmt: skip
        messages, replies = run_agent(agent(proxy), 20)
        assert len(replica.received()) == 20
    return record_dir, messages, [summary(r) for r in replies]


@pytest.mark.parametrize("stream", [False, True])
def test_a_recorded_twenty_turn_session_replays_with_no_backend(recorded, tmp_path: Path, stream: bool) -> None:
    record_dir, messages, replies = recorded
    with replay_proxy(record_dir, tmp_path) as proxy:
        again_messages, again = run_agent(agent(proxy), 20, stream=stream)
        assert "replaying 20 recorded turns of 1 session from" in proxy.output()
        assert "no backend is contacted" in proxy.output() and "reverse proxy to http://tito-replay.invalid:1" in (
            proxy.output()
        )
    assert [summary(r) for r in again] == replies, "every turn is reproduced"
    assert again_messages == messages


def test_a_request_with_no_recorded_match_is_a_404_naming_the_closest_turn(recorded, tmp_path: Path) -> None:
    record_dir, messages, _ = recorded
    with replay_proxy(record_dir, tmp_path) as proxy:
        changed = [dict(m) for m in messages[:5]]
        changed[3] = {**changed[3], "content": f"something else {uuid.uuid4().hex}"}
        response = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": changed})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "replay_miss" and error["first_differing_message"]["index"] == 3
    assert error["closest_turn"]["turn_id"] == 0 and error["matched_messages"] == 3


def test_a_miss_can_be_served_live_and_recorded(recorded, tmp_path: Path) -> None:
    record_dir, messages, _ = recorded
    live_dir = tmp_path / "live"
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica:
        proxy = replay_proxy(
            record_dir, tmp_path, "--mode", f"reverse:{replica.url}", "--set", "tito_replay_fallback=live",
            "--set", f"tito_tokenizer={tokenizer_path('qwen3')}", "--set", "tito_model_family=qwen3",
            "--set", f"tito_record_dir={live_dir}",
        )  # fmt: skip
        with proxy:
            known = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": messages[:2]})
            assert known.status_code == 200 and known.headers["x-tito-replay"]
            fresh = [{"role": "user", "content": "A question never asked before."}]
            served = post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": fresh})
            assert served.status_code == 200 and "x-tito-replay" not in served.headers
        assert len(replica.received()) == 1
    assert len(list(live_dir.glob("*.jsonl"))) == 1


def test_a_flow_file_regenerates_its_trajectories_offline(tmp_path: Path) -> None:
    """`mitmdump -w` keeps each turn's record in flow.metadata; `mitmdump -r` through the addon writes them again."""
    import subprocess

    from support.proxy_harness import REPO

    from tito_addon.records.record_reader import iter_session_files

    original, regenerated, flows = tmp_path / "rec", tmp_path / "regen", tmp_path / "flows.mitm"
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=original, cwd=tmp_path,
        extra_args=["-w", str(flows)],
    ) as proxy:  # fmt: skip
        run_agent(agent(proxy, "captured"), 3)
        run_agent(agent(proxy), 2, stream=True, first="Weather in Quito?")
    mitmdump = Path(sys.executable).with_name("mitmdump")
    argv = [str(mitmdump), "-n", "-q", "-r", str(flows), "-s", str(REPO / "tito_addon" / "__init__.py"),
            "--set", f"tito_record_dir={regenerated}"]  # fmt: skip
    for _ in range(2):  # a second pass adds nothing: turns already on disk are not written twice
        result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    def turns(directory: Path) -> dict:
        return {f.turns[0].session_id: [t.model_dump() for t in f.turns] for f in iter_session_files(directory)}

    assert turns(regenerated) == turns(original)
    assert sum(len(v) for v in turns(regenerated).values()) == 5
