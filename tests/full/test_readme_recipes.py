"""The README's Getting started, run as written: every block marked `<!-- recipe: NAME -->` is run by bash, word for
word, in a scratch view of the repository (its entries linked, `recordings/` and the Codex and Gemini CLI homes its
own) beside the workspace's `shared/`, inside a fresh network namespace that holds only loopback, so the recipes'
fixed ports are free and nothing they do can leave the machine.

The blocks, in order: `install` (make venv, make agent-clis and make demo: no-ops or offline once installed, which
the `agent_clis` fixture does outside the namespace), then `terminal` before each of the others, as the README asks
of every terminal; `backend` and `proxy` run in the background until the end; `openai-python`, `claude-code`
(Claude Code 2.1.332), `codex` (Codex 0.171.0 with `-m qwen3` and `-m gpt-oss-20b`) and `gemini-cli` (Gemini CLI
0.61.0) each capture a session named by its API key; `look` shows, exports and audits them. Codex without `-m` (its
default model) is the codex block's own command with `-m` taken out: it must get the 400 the README describes, and
record nothing. `driver` runs examples/rollout_driver.py over Claude Code (2 tasks x 2 samples) into one verl-layout
Parquet file, and `verl-step` feeds that file to verl's GRPO `compute_advantage` in `.venv-trainers`: run where that
environment exists, which CI guarantees (`make test-all` builds it before its serial group; TITO_TRAINERS_REQUIRED=1
fails the test without it), skipped elsewhere with the rest of the test still run.

What is checked: every block's exit status; each agent's session on disk token exact against what the backend
process says it generated (`GET /_replica/generated`), one chain of exact ids with three tool round trips per
prompt whose results hold what the real tool printed; the export's rows; and that the agent table's rows say what
the recipes run. The run takes about 40 s (the full tier, alone on the machine); the table check is cheap and runs in
`make test` (test_readme_agent_table.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pyarrow.parquet as pq
import pytest
from support.agent_cli_stack import HostLoopback, Network, agent_clis, base_env, network  # noqa: F401 (fixtures)
from support.basics import SHARED, wait_until
from support.proxy_harness import REPO
from support.readme_recipes import engine_recipes, recipes

from tito_addon.records.record_reader import iter_session_files

DRIVER_TASKS, DRIVER_SAMPLES = ["list-folder", "count-files"], 2  # examples/shell_tasks.jsonl, the recipe's --samples
TRAINERS = REPO / ".venv-trainers" / "bin" / "python"
BACKEND, PROXY = 30000, 8080  # the recipes' own ports
SESSIONS = {"weather": "chat", "claude": "anthropic_messages", "codex": "openai_responses",
            "codex-oss": "openai_responses", "gemini": "gemini"}  # fmt: skip
TOOL_ROUNDS = 3  # the backend recipe's --tool-rounds
BLOCK_TIMEOUT_S = 240
# Entries of the repository the scratch view does not link: what the recipes write, and what they must not see.
OWN = {".git", "recordings", "codex-home", "gemini-home", "rows.parquet", "rollouts.parquet", "build"}


# ---------------------------------------------------------------------------------------------- running blocks


class Scratch:
    """The repository as a newcomer's clone looks from its root, with its own recordings, beside shared/."""

    def __init__(self, root: Path, namespace: Network, bin_env: dict[str, str]) -> None:
        self.root = root / "main"
        self.root.mkdir(parents=True)
        (root / "shared").symlink_to(SHARED)
        for entry in REPO.iterdir():
            if entry.name not in OWN:
                (self.root / entry.name).symlink_to(entry)
        (self.root / "recordings").mkdir()
        self.network = namespace
        self.env = bin_env
        self.background: list[subprocess.Popen[str]] = []
        self.logs: dict[str, Path] = {}

    def script(self, name: str, block: str) -> list[str]:
        prelude = "" if name == "install" else recipes()["terminal"]
        return self.network.command(["bash", "-e", "-c", prelude + block])

    def run(self, name: str, block: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.script(name, block), cwd=self.root, env=self.env, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip

    def start(self, name: str, block: str) -> subprocess.Popen[str]:
        log = self.root.parent / f"{name}.log"
        self.logs[name] = log
        with log.open("w") as out:
            process = subprocess.Popen(
                self.script(name, block), cwd=self.root, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )  # fmt: skip
        self.background.append(process)
        return process

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def inside(self, action: Callable[[], Any]) -> Any:
        """`action` run on a thread that joined the namespace, where the recipes' 127.0.0.1 is."""
        result: list[Any] = []

        def target() -> None:
            self.network.enter_this_thread()
            try:
                result.append(action())
            except Exception as error:  # the caller asserts on the outcome
                result.append(error)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(timeout=60)
        return result[0] if result else TimeoutError(action)

    def listening(self, port: int) -> bool:
        def connect() -> bool:
            with socket.socket() as probe:
                probe.settimeout(1)
                return probe.connect_ex(("127.0.0.1", port)) == 0

        return self.inside(connect) is True

    def get_json(self, url: str) -> Any:
        def fetch() -> Any:
            with urllib.request.urlopen(url, timeout=30) as reply:
                return json.loads(reply.read())

        got = self.inside(fetch)
        assert not isinstance(got, Exception), got
        return got

    def stop(self) -> None:
        for process in self.background:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)  # mitmdump closes its sessions on the way out
        for process in self.background:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def ran(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


# ---------------------------------------------------------------------------------------------- the test


@pytest.mark.full
@pytest.mark.serial  # fixed ports in a namespace of its own, but the real CLIs as in test_agent_clis
def test_getting_started_runs_as_written(network: Network, agent_clis: Path, tmp_path: Path) -> None:  # noqa: F811
    if isinstance(network, HostLoopback):
        pytest.skip("the recipes' fixed ports need a network namespace of their own")
    if not (SHARED / "tokenizers" / "qwen3").is_dir() or not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("the recipes run beside ../shared/tokenizers, in the repository's .venv (make venv)")
    blocks = recipes()
    env = base_env(tmp_path / "home", Path("/nonexistent"))  # the recipes put the venv and the CLIs on PATH
    scratch = Scratch(tmp_path / "ws", network, env)
    try:
        installed = scratch.run("install", blocks["install"])
        assert installed.returncode == 0 and "every recorded turn is token-exact" in installed.stdout, ran(installed)
        backend = scratch.start("backend", blocks["backend"])
        proxy = scratch.start("proxy", blocks["proxy"])
        for name, process, port in (("backend", backend, BACKEND), ("proxy", proxy, PROXY)):
            up = wait_until(lambda p=port, pr=process: pr.poll() is not None or scratch.listening(p), timeout=90)
            assert up and process.poll() is None, (name, scratch.log(name)[-4000:])

        agents = ("openai-python", "claude-code", "codex", "gemini-cli")
        runs = {name: scratch.run(name, blocks[name]) for name in agents}
        for name, result in runs.items():
            assert result.returncode == 0, (name, ran(result), scratch.log("proxy")[-4000:])

        # Codex with its own default model: the codex recipe's first command without `-m`.
        config, _, commands = blocks["codex"].partition("EOF\nLOCAL_KEY=")
        first = "LOCAL_KEY=" + commands.splitlines()[0]
        assert " -m qwen3 " in first, first
        default = first.replace(" -m qwen3 ", " ").replace("sk-tito-codex ", "sk-tito-codex-default ")
        refused = scratch.run("codex", config + "EOF\n" + default)
        shown = refused.stdout + refused.stderr
        assert refused.returncode != 0, ran(refused)
        assert "'additional_tools' items are not supported" in shown and "-m qwen3" in shown, ran(refused)

        generated = scratch.get_json(f"http://127.0.0.1:{BACKEND}/_replica/generated")
        looked = scratch.run("look", blocks["look"])
        assert looked.returncode == 0, ran(looked)
        driven = scratch.run("driver", blocks["driver"])
        assert driven.returncode == 0, (ran(driven), scratch.log("proxy")[-4000:])
        verl_step = None
        if TRAINERS.exists():
            verl_step = scratch.run("verl-step", blocks["verl-step"])
            assert verl_step.returncode == 0, ran(verl_step)
        elif os.environ.get("TITO_TRAINERS_REQUIRED") == "1":
            pytest.fail(f"{TRAINERS} is missing: run scripts/setup_trainers.sh (the verl-step recipe needs it)")
    finally:
        scratch.stop()

    proxy_log = scratch.log("proxy")
    assert not re.findall(r"<< 5\d\d\b.*", proxy_log), proxy_log[-6000:]
    # The refused request is the log's only 4xx but the driver's preflight: its tokenless probe of the control API (a
    # 401: the control host is served) and its check that each episode name is unused (a 404 each). No agent had a
    # request refused and retried out of sight. (mitmdump logs a reverse-mode request by the backend URL it would
    # have gone to, even one the proxy answers itself, and cuts long URLs short.)
    answered = re.findall(r"^\S+: (\S+) (\S+)[^\n]*\n\s*<< (4\d\d)\b", proxy_log, re.M)
    probes = [r for r in answered if (r[0], urlsplit(r[1]).path, r[2]) == ("GET", "/v1/info", "401")]
    unused = [r for r in answered if r[0] == "GET" and urlsplit(r[1]).path.startswith("/v1/sessions/run-") and
              r[2] == "404"]  # fmt: skip
    others = [r for r in answered if r not in probes and r not in unused]
    assert len(probes) == 1 and len(unused) == len(DRIVER_TASKS) * DRIVER_SAMPLES, answered
    assert len(others) == 1 and others[0][2] == "400", answered  # Codex's default model

    record_dir = scratch.root / "recordings"
    files = {f.turns[0].session_id: f for f in iter_session_files(record_dir) if f.turns}
    assert SESSIONS.keys() <= files.keys() and "codex-default" not in files, sorted(files)
    by_prompt = {tuple(g["prompt_ids"]): g["completion_ids"] for g in generated}
    recorded = 0
    for session_id, api in SESSIONS.items():
        session = files[session_id]
        ids = session.full_ids()
        turns = session.turns
        assert {t.api for t in turns} == {api}, (session_id, {t.api for t in turns})
        # One chain: each turn continues the one before it, and its prompt starts with that turn's exact ids.
        assert [t.parent_turn_id for t in turns] == [None, *[t.turn_id for t in turns[:-1]]], session_id
        for before, after in zip(turns, turns[1:], strict=False):
            end = ids[before.turn_id][0] + ids[before.turn_id][1]
            assert ids[after.turn_id][0][: len(end)] == end, (session_id, after.turn_id)
        for turn in turns:
            prompt, completion = ids[turn.turn_id]
            assert by_prompt.get(tuple(prompt)) == completion, (session_id, turn.turn_id)  # what the backend made
        # Three tool round trips, then the answer; every result is what the real tool (or the agent's) returned.
        assert [t.finish_reason for t in turns] == ["tool_calls"] * TOOL_ROUNDS + ["stop"], session_id
        for call, result in zip(turns, turns[1:], strict=False):
            calls = call.assistant_message.get("tool_calls") or []
            results = [m for m in result.appended_messages or [] if m.get("role") == "tool"]
            if call.finish_reason == "tool_calls":
                assert sorted(m["tool_call_id"] for m in results) == sorted(c["id"] for c in calls), session_id
                assert all(text_of(m.get("content")).strip() for m in results), (session_id, results)
        recorded += len(turns)
    assert recorded == len(generated)  # nothing else reached the backend, nothing was recorded twice

    # `ls` in the repository root: the CLIs' tool results list what is there.
    for session_id in ("claude", "codex", "codex-oss", "gemini"):
        results = [m for t in files[session_id].turns for m in t.appended_messages or [] if m.get("role") == "tool"]
        assert results and all("README.md" in text_of(m.get("content")) for m in results), (session_id, results)

    rows = pq.read_table(scratch.root / "rows.parquet").to_pylist()
    assert sorted(r["session_id"] for r in rows) == sorted(SESSIONS), [r["session_id"] for r in rows]
    for row in rows:
        session = files[row["session_id"]]
        prompt, completion = session.full_ids()[session.turns[-1].turn_id]
        assert row["input_ids"] == prompt + completion
    assert "claude" in looked.stdout and "drift" in looked.stdout.lower(), looked.stdout[-3000:]

    # The driver's batch: one run prefix, every episode a Claude Code session of its own, its rows the records.
    (prefix,) = re.findall(r"^run prefix: (run-[\w-]+)$", driven.stdout, re.M)
    episodes = len(DRIVER_TASKS) * DRIVER_SAMPLES
    assert f"{episodes} episodes (0 failed)" in driven.stdout, ran(driven)
    assert "WARNING: every group's rewards are equal" in driven.stderr, ran(driven)  # the scripted model, as said
    rows = pq.read_table(scratch.root / "rollouts.parquet").to_pylist()
    names = [f"{prefix}-{i:04d}" for i in range(episodes)]
    assert [r["session_id"] for r in rows] == names, [r["session_id"] for r in rows]
    assert [r["uid"] for r in rows] == [t for t in DRIVER_TASKS for _ in range(DRIVER_SAMPLES)]
    assert [r["rollout_id"] for r in rows] == [r["index"] for r in rows] == list(range(episodes))
    for row in rows:
        session = files[row["session_id"]]
        assert {t.api for t in session.turns} == {"anthropic_messages"} and len(session.turns) == TOOL_ROUNDS + 1
        assert [c.reason for c in session.closes] == ["closed"], "the driver closed its episode"
        prompt, completion = session.full_ids()[session.turns[-1].turn_id]
        assert row["prompts"] + row["responses"] == prompt + completion, row["session_id"]
        assert row["reward"] == 1.0, "the default rule: Bash used, then an answer"
    if verl_step is not None:
        lines = verl_step.stdout.splitlines()
        assert lines == [f"group {t}: reward 1.00, largest |advantage| 0.000" for t in DRIVER_TASKS
                         for _ in range(DRIVER_SAMPLES)], ran(verl_step)  # fmt: skip


def routed(scratch: Scratch, router: str) -> list[str]:
    """The engines the recipe's router routes to now (as a person would check before starting agents)."""
    if router == "smg":
        workers = scratch.get_json("http://127.0.0.1:8100/workers").get("workers", [])
        return [w["url"] for w in workers if w.get("is_healthy") and w.get("status", "ready") == "ready"]
    return scratch.get_json("http://127.0.0.1:8100/list_workers").get("urls", [])


@pytest.mark.full
@pytest.mark.serial  # the routers' and engines' fixed ports, in a namespace of its own
@pytest.mark.parametrize(("kind", "router", "engines"), [("vllm", "vllm", (8000, 8001, 8002)),
                                                          ("sglang", "smg", (30000, 30001, 30002))])  # fmt: skip
def test_many_engines_recipes_run_as_written(
    network: Network,  # noqa: F811
    tmp_path: Path,
    kind: str,
    router: str,
    engines: tuple[int, ...],
) -> None:
    """Many engines' recipes for one router, as written: three stand-in engines, the router over two, the proxy, then
    an agent's session, the third engine added and the first removed through the router's own API, and a second
    session. Both sessions are recorded token-exact against what the engines say they generated; the one after the
    removal ran on none of the first engine's generations."""
    if isinstance(network, HostLoopback):
        pytest.skip("the recipes' fixed ports need a network namespace of their own")
    if not (SHARED / "tokenizers" / "qwen3").is_dir() or not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("the recipes run beside ../shared/tokenizers, in the repository's .venv (make venv)")
    blocks = engine_recipes()
    scratch = Scratch(tmp_path / "ws", network, base_env(tmp_path / "home", Path("/nonexistent")))
    try:
        started = {name: scratch.start(name, blocks[name]) for name in (f"engines-{kind}", f"router-{router}")}
        for port in engines:
            up = wait_until(lambda p=port: scratch.listening(p), timeout=90)
            assert up, scratch.log(f"engines-{kind}")[-4000:]
        up = wait_until(lambda: scratch.listening(8100) and len(routed(scratch, router)) == 2, timeout=60)
        assert up and started[f"router-{router}"].poll() is None, scratch.log(f"router-{router}")[-4000:]
        proxy = scratch.start(f"proxy-{router}", blocks[f"proxy-{router}"])
        up = wait_until(lambda: proxy.poll() is not None or scratch.listening(PROXY), timeout=90)
        assert up and proxy.poll() is None, scratch.log(f"proxy-{router}")[-4000:]
        turns = scratch.run(f"turns-{router}", blocks[f"turns-{router}"])
        assert turns.returncode == 0, (ran(turns), scratch.log(f"proxy-{router}")[-4000:])
        generated = [scratch.get_json(f"http://127.0.0.1:{port}/_replica/generated") for port in engines]
    finally:
        scratch.stop()
    ran_on: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for index, entries in enumerate(generated):
        for entry in entries:
            ran_on.setdefault((tuple(entry["prompt_ids"]), tuple(entry["completion_ids"])), []).append(index)
    sessions = {f.turns[0].session_id: f for f in iter_session_files(scratch.root / "recordings") if f.turns}
    assert set(sessions) == {"paris", "oslo"}, sorted(sessions)
    for name, session in sessions.items():
        ids = session.full_ids()
        assert len(session.turns) >= 2  # a tool call and the answer
        for turn in session.turns:
            prompt, completion = ids[turn.turn_id]
            where = ran_on.get((tuple(prompt), tuple(completion)), [])
            assert where, (name, turn.turn_id)  # token-exact, by an engine's own log
            if name == "oslo":
                assert 0 not in where, (name, turn.turn_id, where)  # removed before this session began
