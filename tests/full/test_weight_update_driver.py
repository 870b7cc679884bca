"""A rollout shaped like an async RL loop's: 32 agents run tool-using episodes through one mitmdump while a trainer
pushes 5 weight updates into the engine, each an abort-mode pause, a new version and the resume: vLLM's
`/pause?mode=abort`, `/update_weight_version`, `/resume`; sglang's `/pause_generation {"mode": "abort"}`,
`/update_weight_version`, `/continue_generation`.

Half the agents are openai-python chat agents, half the anthropic SDK streaming Messages as Claude Code does. No
agent may see an error or a cut answer; every recorded turn's ids are exactly what the engine generated across its
attempts (each resubmission on prompt + everything before), each resumed turn says so, and the exported per-token
weight versions are the labels the engine sampled each token under (sglang's chat stream reports no versions: a
streamed attempt's tokens are recorded with none, never with a made-up one).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import anthropic
import openai
import pytest
from support.anthropic_agent import TOOLS as ANTHROPIC_TOOLS
from support.anthropic_agent import echo as anthropic_echo
from support.anthropic_agent import tool_results
from support.basics import TOOLS, echo, tokenizer_path
from support.proxy_harness import REPO, Mitmdump, post

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread

pytestmark = [pytest.mark.full, pytest.mark.serial]

AGENTS, TURNS, UPDATES = 32, 4, 5


def chat_episode(url: str, name: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", default_headers={"x-session-id": name},
                           max_retries=0, timeout=120)  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": f"Weather in Paris? ({name})"}]
    finishes = []
    for turn in range(TURNS):
        reply = client.chat.completions.create(model="tiny-qwen3", messages=messages, tools=TOOLS)
        message, finish = reply.choices[0].message, reply.choices[0].finish_reason
        finishes.append(finish)
        messages.append(echo(message))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"21 C ({turn})"})
        else:
            messages.append({"role": "user", "content": f"And Oslo, round {turn}?"})
    return finishes


def messages_episode(url: str, name: str) -> list[str]:
    client = anthropic.Anthropic(base_url=url, api_key="sk-ant-k", default_headers={"x-session-id": name},
                                 max_retries=0, timeout=120)  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": f"What is the weather in Rome? ({name})"}]
    finishes = []
    for turn in range(TURNS):
        with client.messages.stream(model="tiny-qwen3", max_tokens=1024, tools=ANTHROPIC_TOOLS,
                                    messages=messages) as stream:  # fmt: skip
            reply = stream.get_final_message()
        finishes.append(reply.stop_reason)
        messages.append(anthropic_echo(reply))
        if reply.stop_reason == "tool_use":
            messages.append(tool_results(reply))
        else:
            messages.append({"role": "user", "content": [{"type": "text", "text": f"And Lima, round {turn}?"}]})
    return finishes


def engine_for(kind: str):
    """The replica, its trainer-side calls (pause in abort mode, relabel, resume) and what it generated."""
    if kind == "vllm":
        config = VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), token_delay_s=0.004, max_model_len=32768)
        return VllmReplicaThread(config), ("/pause?mode=abort", None, "/resume")
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), token_delay_s=0.004, context_length=32768)
    return ReplicaThread(config), ("/pause_generation", {"mode": "abort"}, "/continue_generation")


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_thirty_two_agents_through_five_weight_updates(tmp_path, kind) -> None:
    engine, (pause, pause_body, resume) = engine_for(kind)
    record_dir = tmp_path / "rec"
    with engine as replica, Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
        options={"tito_backend_kind": kind},
    ) as proxy:  # fmt: skip
        results: dict[str, list[str]] = {}
        errors: list[str] = []

        def run(kind: str, name: str) -> None:
            try:
                episode = chat_episode if kind == "chat" else messages_episode
                results[name] = episode(proxy.url, name)
            except Exception as exc:  # every agent's failure is reported, not only the first
                errors.append(f"{name}: {exc!r}")

        agents = [threading.Thread(target=run, args=("chat" if i % 2 else "messages", f"agent-{i:02d}"))
                  for i in range(AGENTS)]  # fmt: skip
        for agent in agents:
            agent.start()
        for update in range(1, UPDATES + 1):  # the trainer: an update every half second while the agents run
            time.sleep(0.5)
            assert post(replica.url + pause, json=pause_body, timeout=60).status_code == 200
            post(replica.url + "/update_weight_version", json={"new_version": f"step-{update}"})
            time.sleep(0.1)
            post(replica.url + resume)
        for agent in agents:
            agent.join(300)
        assert not errors, errors
        assert len(results) == AGENTS
        finished = {f for finishes in results.values() for f in finishes}
        assert finished <= {"stop", "tool_calls", "end_turn", "tool_use"}, finished  # never a cut answer
        generated = replica.generated() if kind == "vllm" else replica.backend.generated_copy()
        cut = replica.backend.pause.aborted

    # Every recorded turn is the chain of engine requests that generated it: the first on its prompt, each next one
    # on the prompt and everything before, the labels of their tokens its per-token versions.
    by_prompt = {tuple(g["prompt_ids"]): g for g in generated}
    turns = [turn for session in iter_session_files(record_dir) for turn in session.turns]
    full = {(s.turns[0].session_id, t): ids for s in iter_session_files(record_dir) for t, ids in s.full_ids().items()}
    assert len(turns) == AGENTS * TURNS
    resumed = 0
    for turn in turns:
        prompt, completion = full[(turn.session_id, turn.turn_id)]
        chain, sampled, labels = 0, [], []
        while len(sampled) < len(completion):
            step = by_prompt[tuple(prompt + sampled)]
            sampled += step["completion_ids"]
            labels += step["labels"]
            chain += 1
        versions = turn.token_weight_versions()
        assert sampled == completion and len(labels) == len(versions)
        if kind == "sglang" and turn.api == "anthropic_messages":  # streamed: the first attempt's versions unsaid
            first = len(by_prompt[tuple(prompt)]["completion_ids"])
            assert versions[:first] == [None] * first and versions[first:] == labels[first:]
        else:
            assert labels == versions
        assert (turn.resumed.attempts if turn.resumed else 1) == chain
        resumed += chain > 1
    assert resumed >= UPDATES and cut >= resumed, (resumed, cut)
    # Exported, each sampled token carries the version the engine sampled it under.
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "-m", "tito_addon", "export", str(record_dir), str(out), "--to", "jsonl"],
                          cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    by_turn = {(t.session_id, t.turn_id): t for t in turns}
    for row in map(json.loads, out.read_text().splitlines()):
        sampled_versions = [v for v, bit in zip(row["rollout_weight_versions"], row["loss_mask"], strict=True) if bit]
        path = [by_turn[(row["session_id"], t)] for t in row["turn_ids"]]
        assert sampled_versions == [v or "" for t in path for v in t.token_weight_versions()]
    print(f"\n{len(turns)} turns, {resumed} resumed, {cut} generations cut by {UPDATES} updates")
