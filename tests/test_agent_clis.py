"""The real Claude Code and Codex CLIs, unmodified, through a real mitmdump to the sglang replica: every turn token
exact, tool round trips and a second invocation (`--continue`, `resume --last`) on one chain of exact ids.

Pinned in tests/agent_clis/package.json (installed by the `agent_clis` fixture with `npm ci` when missing):
- `@anthropic-ai/claude-code` 2.1.332: declares Node >= 22, but `claude` is the native linux-x64 binary of its
  platform package and runs under Node 20 (npm only warns about the engine).
- `@openai/codex` 0.171.0: `codex` is a Node launcher (Node >= 16) for the native binary of
  `@openai/codex-linux-x64`.

Command lines (run from a scratch project directory, HOME a scratch directory, nothing else inherited):

    ANTHROPIC_BASE_URL=http://127.0.0.1:PORT ANTHROPIC_API_KEY=KEY CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 \
    DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1 DISABLE_AUTOUPDATER=1 \
        claude -p PROMPT --allowedTools Bash --output-format stream-json --verbose
        claude -p --continue PROMPT2 --allowedTools Bash --output-format stream-json --verbose

    CODEX_HOME=DIR LOCAL_KEY=KEY (DIR/config.toml: CODEX_CONFIG below)
        codex exec --skip-git-repo-check --json -m qwen3 PROMPT </dev/null
        codex exec --skip-git-repo-check --json -m qwen3 resume --last PROMPT2 </dev/null

Isolation: one fresh network namespace per module (`unshare --net`, loopback up, nothing else) holds the whole
stack. The replica's server thread joins it with setns(2) (a namespace is per thread, and a socket stays in the
namespace it was made in), mitmdump and every CLI run as `nsenter --net=… CMD`. They reach each other on 127.0.0.1
and nothing beyond; pytest itself stays outside and reads the records from disk and the replica from memory. Where
`unshare --net` is refused (no CAP_SYS_ADMIN) the stack runs on the host's loopback instead, relying only on the
CLIs' own switches (the environment above; Codex's update check, analytics and feedback off in config.toml), with
a warning; `TITO_AGENT_NETNS_REQUIRED=1` (CI) makes that a failure.

The replica's script is steered (`preferred_tools`, `tool_rounds`) to call the CLIs' shell tools (`Bash`,
`exec_command`) for TOOL_ROUNDS rounds per prompt (one of them, the replica's every-third turn, with two parallel
calls), then answer, so each invocation ends by itself. The command prints a marker and the network namespace it ran
in, so the tool results prove where the CLI ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from conftest import API_KEYS, tokenizer_path
from proxy_harness import REPO, Mitmdump
from test_anthropic_messages import assert_token_exact

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

# The full tier, alone on the machine: the real CLIs (an 800 MB npm install the first time) under their own timeouts.
pytestmark = [pytest.mark.full, pytest.mark.serial]

CLI_DIR = REPO / "tests" / "agent_clis"
PINNED = json.loads((CLI_DIR / "package.json").read_text())["dependencies"]
MARKER = "tito-ok"
# The shell command the model runs: the marker and the network namespace the command ran in, which proves that the
# CLI (whose child it is) ran in the test's namespace.
COMMAND = f"echo {MARKER} $(readlink /proc/self/ns/net)"
TOOL_ROUNDS = 3  # tool turns per prompt, then the answer
PREFERRED_TOOLS = {
    "Bash": {"command": COMMAND, "description": "Print a marker"},  # Claude Code
    "exec_command": {"cmd": COMMAND},  # Codex
}
API_KEY = API_KEYS[0]  # one the session-wide audit looks for in every proxy log and recording
CLI_TIMEOUT_S = 180
CODEX_CONFIG = """\
model_provider = "local"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.local]
name = "local"
base_url = "{base_url}/v1"
env_key = "LOCAL_KEY"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false
"""


# ---------------------------------------------------------------------------------------------- network isolation


class LoopbackNamespace:
    """A fresh network namespace with only loopback (up), held open by a sleeping `unshare --net` process."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.holder.stdout is not None
        if self.holder.stdout.readline().strip() != "up":  # EOF when unshare or ip failed
            self.holder.wait(timeout=10)
            raise OSError(f"unshare --net failed: {self.holder.stderr.read().strip() if self.holder.stderr else ''}")
        # unshare and sh exec in place: the holder's pid is the namespace's process.
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self.inode = os.readlink(self.path)  # "net:[N]", what a process inside reads from /proc/self/ns/net

    def command(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net={self.path}", "--", *argv]

    def enter_this_thread(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait(timeout=10)


class HostLoopback:
    """The fallback where namespaces are refused: the host's own network, commands unchanged."""

    inode = os.readlink("/proc/self/ns/net")

    def command(self, argv: list[str]) -> list[str]:
        return argv

    def enter_this_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


Network = LoopbackNamespace | HostLoopback


class NamespacedReplica(ReplicaThread):
    """The replica with its server thread inside the namespace, so mitmdump there can reach it."""

    def __init__(self, config: ReplicaConfig, network: Network) -> None:
        super().__init__(config)
        self.network = network

    def _run(self) -> None:
        # Only this thread joins: pytest's other threads stay on the host; the listening socket made below lives
        # in the namespace for good.
        self.network.enter_this_thread()
        super()._run()


@pytest.fixture(scope="module")
def network():
    try:
        namespace: Network = LoopbackNamespace()
    except OSError as error:
        if os.environ.get("TITO_AGENT_NETNS_REQUIRED") == "1":
            pytest.fail(f"a network namespace is required here: {error}")
        warnings.warn(f"no network namespace ({error}): the CLIs run on the host's loopback", stacklevel=1)
        namespace = HostLoopback()
    try:
        yield namespace
    finally:
        namespace.close()


# ---------------------------------------------------------------------------------------------- the stack


def installed_version(package: str) -> str | None:
    manifest = CLI_DIR / "node_modules" / package / "package.json"
    return json.loads(manifest.read_text()).get("version") if manifest.is_file() else None


@pytest.fixture(scope="module")
def agent_clis() -> Path:
    """tests/agent_clis/node_modules/.bin, installed from the committed lock when missing or not the pinned one."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("node and npm are not installed: the real agent CLIs run on Node")
    bin_dir = CLI_DIR / "node_modules" / ".bin"
    stale = any(installed_version(package) != version for package, version in PINNED.items())
    if stale or not all((bin_dir / name).exists() for name in ("claude", "codex")):
        # `npm ci` starts from an empty node_modules and installs exactly the lock (with the platform binaries).
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=CLI_DIR, check=True, timeout=600)
    # The binaries themselves run here and are the pinned releases.
    for name, package in (("claude", "@anthropic-ai/claude-code"), ("codex", "@openai/codex")):
        shown = subprocess.run([bin_dir / name, "--version"], capture_output=True, text=True, timeout=60)
        assert PINNED[package] in shown.stdout, (name, shown.returncode, shown.stdout, shown.stderr)
    return bin_dir


@pytest.fixture(scope="module")
def replica(network):
    config = ReplicaConfig(tokenizer=tokenizer_path("qwen3"), preferred_tools=PREFERRED_TOOLS, tool_rounds=TOOL_ROUNDS)
    with NamespacedReplica(config, network) as running:
        yield running


@pytest.fixture
def proxy(network, replica, tmp_path: Path):
    replica.backend.reset()
    record_dir = tmp_path / "rec"
    launcher = network.command([])
    with Mitmdump(
        replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path, launcher=launcher
    ) as running:
        yield running


@dataclass
class CliRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def events(self) -> list[dict[str, Any]]:
        """The JSON lines of stdout (both CLIs print one event per line)."""
        out = []
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def __str__(self) -> str:
        return f"{self.argv[-8:]} -> {self.returncode}\nstdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}"


def run_cli(network: Network, argv: list[str], *, env: dict[str, str], cwd: Path, ok: tuple[int, ...] = (0,)) -> CliRun:
    """One CLI invocation in the namespace, stdin closed, killed with its process group past CLI_TIMEOUT_S; its exit
    status must be one of `ok`."""
    process = subprocess.Popen(
        network.command(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the CLI and the tool commands it started, nothing else
        stdout, stderr = process.communicate()
        pytest.fail(f"{argv[:3]} ran past {CLI_TIMEOUT_S}s:\n{CliRun(argv, -9, stdout, stderr)}")
    run = CliRun(argv, process.returncode, stdout, stderr)
    assert run.returncode in ok, str(run)
    return run


def base_env(home: Path, bin_dir: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no proxy variables, API keys or config of the machine's user leak in."""
    home.mkdir(parents=True, exist_ok=True)
    node_dir = os.path.dirname(shutil.which("node") or "/usr/bin/node")  # `codex` is a `#!/usr/bin/env node` script
    path = os.pathsep.join([str(bin_dir), node_dir, "/usr/local/bin", "/usr/bin", "/bin"])
    return {"PATH": path, "HOME": str(home), "SHELL": "/bin/bash", "LANG": "C.UTF-8", **extra}


# ---------------------------------------------------------------------------------------------- assertions


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


def assert_one_exact_chain(
    proxy: Mitmdump, replica: ReplicaThread, api: str, first_run_turns: int, printed: str
) -> list:
    """The recorded session is one chain in which every request extends the previous turn's exact ids, it holds
    TOOL_ROUNDS real tool round trips per invocation (each result holding what the shell `printed`), and the second
    invocation continues the first."""
    # Nothing was refused or failed on the way: a CLI retries a failed request, which would hide it from the records.
    refused = re.findall(r"<< ([45]\d\d\b.*)", proxy.output())
    assert not refused, (refused, proxy.output()[-6000:])
    turns = assert_token_exact(proxy.record_dir, replica)  # ids on disk == ids the replica got and generated
    files = list(iter_session_files(proxy.record_dir))
    assert len(files) == 1, [f.path.name for f in files]
    assert all(turn.api == api for turn in turns), {turn.api for turn in turns}
    # A chain: each turn's parent is the turn before it (the previous request of the agent, nothing branched).
    assert [t.parent_turn_id for t in turns] == [None, *[t.turn_id for t in turns[:-1]]]
    # Independently of the records: each prompt the replica received starts with the previous prompt + completion.
    generated = replica.generated()
    for before, after in zip(generated, generated[1:], strict=False):
        end = before["prompt_ids"] + before["completion_ids"]
        assert after["prompt_ids"][: len(end)] == end
    # Tool round trips: a tool-call turn, then a turn whose appended messages are the tools' results, all of which
    # carry what the shell printed (the real tool ran, inside the namespace).
    round_trips = 0
    for call_turn, result_turn in zip(turns, turns[1:], strict=False):
        calls = call_turn.assistant_message.get("tool_calls") or []
        if call_turn.finish_reason != "tool_calls":
            continue
        results = [m for m in result_turn.appended_messages or [] if m.get("role") == "tool"]
        assert sorted(m["tool_call_id"] for m in results) == sorted(c["id"] for c in calls), result_turn
        assert all(printed in text_of(m.get("content")) for m in results), (printed, results)
        round_trips += 1
    assert round_trips == 2 * TOOL_ROUNDS >= 2, [t.finish_reason for t in turns]
    # Each invocation: TOOL_ROUNDS tool turns, then the answer that ended it.
    first, second = turns[:first_run_turns], turns[first_run_turns:]
    for run in (first, second):
        assert [t.finish_reason for t in run] == ["tool_calls"] * TOOL_ROUNDS + ["stop"]
    # The second invocation continued the same tree: its first turn hangs off the first invocation's last one.
    assert second[0].parent_turn_id == first[-1].turn_id
    assert second[0].session_id == first[-1].session_id
    return turns


# ---------------------------------------------------------------------------------------------- tests


def test_the_namespace_holds_only_loopback(network: Network) -> None:
    if isinstance(network, HostLoopback):
        pytest.skip("no network namespace here")
    shown = subprocess.run(network.command(["ip", "-o", "link", "show"]), capture_output=True, text=True, timeout=30)
    links = [line.split(":")[1].strip() for line in shown.stdout.splitlines()]
    assert links == ["lo"], shown.stdout
    assert network.inode != os.readlink("/proc/self/ns/net")  # what the CLIs' shell commands print is telling


def test_claude_code_cli_is_token_exact(
    network: Network, agent_clis: Path, proxy: Mitmdump, replica, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    env = base_env(
        tmp_path / "home",
        agent_clis,
        ANTHROPIC_BASE_URL=proxy.url,
        ANTHROPIC_API_KEY=API_KEY,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )
    # The prompt goes before --allowedTools, which takes a list.
    tail = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
    claude = str(agent_clis / "claude")
    first = run_cli(network, [claude, "-p", "Check this folder with Bash.", *tail], env=env, cwd=project)
    first_turns = len(replica.generated())
    second = run_cli(network, [claude, "-p", "--continue", "Check it once more.", *tail], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_one_exact_chain(proxy, replica, "anthropic_messages", first_turns, printed)
    # What the CLI saw: a successful result per invocation, and every Bash call ran in the namespace.
    for run in (first, second):
        events = run.events()
        result = events[-1]
        assert result["type"] == "result" and result["subtype"] == "success" and not result["is_error"], str(run)
        uses = [
            block
            for event in events
            if event["type"] == "assistant"
            for block in event["message"]["content"]
            if block["type"] == "tool_use"
        ]
        outputs = [
            block
            for event in events
            if event["type"] == "user"
            for block in event["message"]["content"]
            if isinstance(block, dict) and block.get("type") == "tool_result"
        ]
        # One round per invocation is the replica's parallel turn (every third turn of the session): two calls.
        assert [u["name"] for u in uses] == ["Bash"] * (TOOL_ROUNDS + 1), str(run)
        assert len(outputs) == len(uses) and all(printed in text_of(o["content"]) for o in outputs), outputs
        assert not any(o.get("is_error") for o in outputs), outputs
    # The new prompt is what the second invocation appended to the stored history.
    appended = turns[first_turns].appended_messages
    assert appended[-1]["role"] == "user" and "Check it once more." in text_of(appended[-1]["content"])


def test_codex_cli_is_token_exact(network: Network, agent_clis: Path, proxy: Mitmdump, replica, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    codex_home = tmp_path / "codex_home"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=proxy.url))
    env = base_env(tmp_path / "home", agent_clis, CODEX_HOME=str(codex_home), LOCAL_KEY=API_KEY)
    codex = [str(agent_clis / "codex"), "exec", "--skip-git-repo-check", "--json", "-m", "qwen3"]
    first = run_cli(network, [*codex, "Check this folder with the shell."], env=env, cwd=project)
    first_turns = len(replica.generated())
    second = run_cli(network, [*codex, "resume", "--last", "Check it once more."], env=env, cwd=project)

    printed = f"{MARKER} {network.inode}"
    turns = assert_one_exact_chain(proxy, replica, "openai_responses", first_turns, printed)
    threads = set()
    for run in (first, second):
        events = run.events()
        threads |= {event["thread_id"] for event in events if event["type"] == "thread.started"}
        assert events[-1]["type"] == "turn.completed", str(run)
        commands = [
            event["item"]
            for event in events
            if event["type"] == "item.completed" and event["item"]["type"] == "command_execution"
        ]
        assert len(commands) == TOOL_ROUNDS + 1, str(run)  # one round is the replica's parallel turn: two calls
        assert all(c["exit_code"] == 0 and printed in c["aggregated_output"] for c in commands), commands
    assert len(threads) == 1  # `resume --last` picked up the first invocation's thread
    appended = turns[first_turns].appended_messages
    assert appended[-1]["role"] == "user" and "Check it once more." in text_of(appended[-1]["content"])


def test_cli_episodes_are_named_by_their_api_key(network: Network, agent_clis: Path, replica, tmp_path: Path) -> None:
    """Claude Code (`ANTHROPIC_API_KEY`) and Codex (its provider's `env_key`) name their episode with a key of the
    configured form; the backend sees only its own key. Then the example driver runs two Claude Code episodes the same
    way, scores and closes them, and writes their rows (all of it inside the namespace)."""
    replica.backend.reset()
    record_dir, token, prefix, backend_key = tmp_path / "rec", "cli-control-token-0123456789", "sk-ep-", API_KEYS[1]
    options = {"tito_session_api_key_prefix": prefix, "tito_backend_api_key": backend_key, "tito_control_token": token}
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path,
                  launcher=network.command([]), options=options) as proxy:  # fmt: skip
        project = tmp_path / "project"
        project.mkdir()
        tail = ["--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
        claude_env = base_env(tmp_path / "home", agent_clis, ANTHROPIC_BASE_URL=proxy.url,
                              ANTHROPIC_API_KEY=prefix + "cc-episode", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                              DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_AUTOUPDATER="1")  # fmt: skip
        run_cli(network, [str(agent_clis / "claude"), "-p", "Check this folder with Bash.", *tail], env=claude_env,
                cwd=project)  # fmt: skip
        codex_home = tmp_path / "codex_home"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(CODEX_CONFIG.format(base_url=proxy.url))
        codex_env = base_env(tmp_path / "home2", agent_clis, CODEX_HOME=str(codex_home), LOCAL_KEY=prefix + "cx-ep")
        codex = [str(agent_clis / "codex"), "exec", "--skip-git-repo-check", "--json", "-m", "qwen3"]
        run_cli(network, [*codex, "Check this folder with the shell."], env=codex_env, cwd=project)
        served = len(replica.received())

        out = tmp_path / "claude-rollouts.parquet"
        driver = [
            sys.executable, str(REPO / "examples" / "rollout_driver.py"), "--proxy", proxy.url, "--token", token,
            "--agent", "claude-code", "--claude", str(agent_clis / "claude"), "--key-prefix", prefix,
            "--tasks", "1", "--samples", "2", "--concurrency", "2", "--prefix", "cc-driven", "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "PATH": base_env(tmp_path / "h3", agent_clis)["PATH"]}
        result = subprocess.run(network.command(driver), env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    headers = replica.backend.received_headers
    keys = [
        h.get("X-Api-Key") or h.get("x-api-key") or h.get("Authorization") or h.get("authorization") for h in headers
    ]
    assert set(keys) <= {backend_key, f"Bearer {backend_key}"} and len(keys) == len(replica.received())
    by_name = {f.turns[0].session_id: f for f in iter_session_files(record_dir)}
    assert sorted(by_name) == ["cc-driven-0000", "cc-driven-0001", "cc-episode", "cx-ep"]
    assert {t.api for t in by_name["cc-episode"].turns} == {"anthropic_messages"}
    assert {t.api for t in by_name["cx-ep"].turns} == {"openai_responses"}
    assert len(by_name["cc-episode"].turns) + len(by_name["cx-ep"].turns) == served
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["session_id"] for r in rows) == ["cc-driven-0000", "cc-driven-0001"]
    assert [(r["group"], r["group_index"]) for r in rows] == [("task-0", 0)] * 2, "one task, one group of two"
    assert all(r["reward"] == 1.0 and "tool_used" in r["labels"] for r in rows), [r["labels"] for r in rows]
    for row in rows:
        recorded = by_name[row["session_id"]]
        assert [c.reason for c in recorded.closes] == ["closed"]
        leaf = recorded.turns[-1]
        prompt, completion = recorded.full_ids()[row["leaf_turn_id"]]
        assert row["input_ids"] == prompt + completion and leaf.session_id == row["session_id"]
