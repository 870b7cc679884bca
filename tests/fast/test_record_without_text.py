"""`tito_record_message_text=false`: a turn line keeps the ids and only digests of the appended messages.

Proven through a real mitmdump against the sglang replica: no message text reaches the disk, the session resumes
after a restart from the digests alone (the next prompt extends the recorded ids), offline replay still answers
the agent, export still yields exact ids, and the audit, which needs the text, refuses clearly.
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.basics import tokenizer_path
from support.proxy_harness import REPO, Mitmdump, post
from support.tito_commands import replay_proxy

from tito_addon.records.record_models import TURN_SCHEMA, TurnRecord
from tito_addon.records.record_reader import read_session_file
from tito_addon.records.trajectory_recorder import session_file_name
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

SECRET_TOOL_OUTPUT = "inventory-row-7f3a9 quantity=4411 warehouse=Kraków"


def turn(proxy: Mitmdump, messages: list[dict]) -> dict:
    response = post(
        proxy.url + "/v1/chat/completions",
        json={"model": "reference-model", "messages": messages},
        headers={"x-session-id": "lean"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def test_digests_instead_of_text_resume_replay_and_export(tmp_path) -> None:
    record_dir = tmp_path / "rec"
    options = {"tito_record_message_text": "false"}
    messages: list[dict] = [{"role": "user", "content": "Count the stock."}]
    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as replica:
        for round_ in range(2):  # the second round is a restarted proxy that must resume from the digests
            with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                          options=options) as proxy:  # fmt: skip
                for step in range(2):
                    reply = turn(proxy, messages)
                    messages += [{"role": "assistant", "content": reply.get("content") or ""},
                                 {"role": "user", "content": f"{SECRET_TOOL_OUTPUT} ({round_}.{step})"}]  # fmt: skip
        received = replica.received()
    path = record_dir / session_file_name("lean")
    for line in path.read_text("utf-8").splitlines():
        record = json.loads(line)
        record.pop("assistant_message", None)  # the model's own output (the replica quotes the question in it)
        rest = json.dumps(record, ensure_ascii=False)
        assert "appended_messages" not in record and SECRET_TOOL_OUTPUT not in rest and "Count the stock" not in rest
        whole = json.loads(line)  # built without a TurnRecord: exactly what one would write
        if whole["schema"] == TURN_SCHEMA:
            assert TurnRecord.model_validate(whole).line_fields() == whole
    session_file = read_session_file(path)
    assert [t.parent_turn_id for t in session_file.turns] == [None, 0, 1, 2]  # resumed, not a new root
    assert all(t.appended_messages is None and t.appended_keys for t in session_file.turns)
    ids = session_file.full_ids()
    assert [b["input_ids"] for b in received] == [ids[t.turn_id][0] for t in session_file.turns]

    # Offline replay answers the agent's requests from the digests alone, with no backend running.
    replies_by_turn = [t.assistant_message.get("content") for t in session_file.turns]
    with replay_proxy(record_dir, tmp_path) as replay:
        for index in range(4):
            asked = messages[: 1 + 2 * index]
            served = post(replay.url + "/v1/chat/completions", json={"model": "reference-model", "messages": asked},
                          timeout=30)  # fmt: skip
            assert served.status_code == 200, served.text
            assert served.json()["choices"][0]["message"]["content"] == replies_by_turn[index]

    exported = subprocess.run(
        [sys.executable, "-m", "tito_addon", "export", str(record_dir), str(tmp_path / "out.jsonl"),
         "--format", "jsonl"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    row = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert row["input_ids"] == ids[3][0] + ids[3][1]
    assert json.loads(row["messages"]) is None
    audit = subprocess.run(
        [sys.executable, "-m", "tito_addon", "audit", str(record_dir), "--tokenizer", tokenizer_path("qwen3")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert audit.returncode == 2 and "without message text" in audit.stderr
