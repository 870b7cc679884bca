"""The stack every real agent CLI test runs on: a loopback-only network namespace, the pinned CLIs, the sglang replica
inside the namespace, a mitmdump there, and the checks that a CLI's session is one token-exact chain of tool rounds.

Pinned in tests/agent_clis/package.json and its lock (installed by the `agent_clis` fixture when missing or stale):
- `@anthropic-ai/claude-code` 2.1.332: declares Node >= 22, but `claude` is the native linux-x64 binary of its
  platform package and runs under Node 20 (npm only warns about the engine).
- `@openai/codex` 0.171.0: `codex` is a Node launcher (Node >= 16) for the native binary of `@openai/codex-linux-x64`.
- `@google/gemini-cli` 0.61.0, `@qwen-code/qwen-code` 0.24.4 and `@mariozechner/pi-coding-agent` 0.73.1: Node
  programs that run on Node 20.
- `opencode-ai` 1.18.33: a launcher for the Bun-compiled binary of `opencode-linux-x64` (its provider packages are
  built into that binary; nothing is installed at run time).
npm's install scripts need not run for any of them: each binary runs straight from its package.

Isolation: one fresh network namespace per module (`unshare --net`, loopback up, nothing else) holds the whole stack.
The replica's server thread joins it with setns(2) (a namespace is per thread, and a socket stays in the namespace it
was made in), mitmdump and every CLI run as `nsenter --net=… CMD`. They reach each other on 127.0.0.1 and nothing
beyond; pytest itself stays outside and reads the records from disk and the replica from memory. Where `unshare
--net` is refused (no CAP_SYS_ADMIN) the stack runs on the host's loopback instead, relying only on the CLIs' own
switches, with a warning; `TITO_AGENT_NETNS_REQUIRED=1` (CI) makes that a failure.

The replica's script is steered (`preferred_tools`, `tool_rounds`) to call each CLI's shell tool for TOOL_ROUNDS rounds
per prompt (one of them, the replica's every-third turn, with two parallel calls), then answer, so each invocation ends
by itself. The command prints a marker and the network namespace it ran in, so the tool results prove where the CLI
ran.

The CLIs' own configuration files, for every test that runs them: Codex's config.toml (CODEX_CONFIG), Gemini CLI's
settings.json (GEMINI_SETTINGS), opencode's opencode.json (`opencode_config`, BASH_ARGS, `stub_plugin_install`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tito_addon.records.record_reader import iter_session_files
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

from .basics import API_KEYS, tokenizer_path
from .proxy_harness import REPO, Mitmdump
from .token_exact import assert_token_exact

CLI_DIR = REPO / "tests" / "agent_clis"
PINNED = json.loads((CLI_DIR / "package.json").read_text())["dependencies"]
# Each CLI's command in node_modules/.bin, and the package that pins it (its --version prints the pinned version).
BINARIES = {
    "claude": "@anthropic-ai/claude-code",
    "codex": "@openai/codex",
    "gemini": "@google/gemini-cli",
    "opencode": "opencode-ai",
    "qwen": "@qwen-code/qwen-code",
    "pi": "@mariozechner/pi-coding-agent",
    # The Node the CLIs run on, pinned with them: Claude Code and Qwen Code declare `engines.node >=22`, and a
    # machine's own Node (Debian's 18, NodeSource's 20) may be older. It comes first on every CLI's PATH.
    "node": "node",
}
MARKER = "tito-ok"
# The shell command the model runs: the marker and the network namespace the command ran in, which proves that the
# CLI (whose child it is) ran in the test's namespace. A pipe, not `$(…)`: Gemini CLI refuses command substitution.
COMMAND = f"readlink /proc/self/ns/net | xargs echo {MARKER}"
TOOL_ROUNDS = 3  # tool turns per prompt, then the answer
CLI_TIMEOUT_S = 180
# The tests that name episodes by API key: the proxy's tito_session_api_key_prefix, and the backend's own key (one the
# session-wide audit looks for in every proxy log and recording).
KEY_PREFIX = "sk-tito-"
BACKEND_KEY = API_KEYS[9]
# Codex's $CODEX_HOME/config.toml: the proxy as a Responses provider; its update check, analytics and feedback off.
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
# Gemini CLI's $HOME/.gemini/settings.json: the API-key auth pinned, usage statistics and telemetry off.
GEMINI_SETTINGS = {
    "security": {"auth": {"selectedType": "gemini-api-key"}},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}
# opencode's bash tool requires `description` besides `command`.
BASH_ARGS = {"command": COMMAND, "description": "Print a marker"}


def opencode_config(npm: str, base_url: str) -> dict[str, Any]:
    """opencode.json: one provider of the given package at the proxy, the key from the environment (`{env:…}` is
    opencode's own substitution, so one file serves every episode); bash allowed, sharing and auto-update off."""
    provider = {"npm": npm, "name": "tito", "options": {"baseURL": base_url, "apiKey": "{env:TITO_API_KEY}"},
                "models": {"qwen3": {"name": "qwen3"}}}  # fmt: skip
    return {"provider": {"tito": provider}, "permission": {"bash": "allow"}, "share": "disabled", "autoupdate": False}


def stub_plugin_install(home: Path) -> None:
    """HOME/.config/opencode as if `@opencode-ai/plugin` were installed there: opencode 1.18.33 runs npm (Arborist)
    for each config directory whose package.json, plus that package, names a dependency its package-lock.json lacks,
    or that has no node_modules (a directory it cannot write is skipped, but root writes anywhere)."""
    config_dir = home / ".config" / "opencode"
    (config_dir / "node_modules").mkdir(parents=True)
    dependencies = {"dependencies": {"@opencode-ai/plugin": "1.18.33"}}
    (config_dir / "package.json").write_text(json.dumps(dependencies))
    (config_dir / "package-lock.json").write_text(json.dumps({"packages": {"": dependencies}}))


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
    if stale or not all((bin_dir / name).exists() for name in BINARIES):
        # The lock's versions (with the platform binaries). `npm install`, not `npm ci`: the lock lacks the platform
        # packages this registry does not serve (opencode's for other systems), which `npm ci` refuses as a lock out of
        # step; the top-level versions are checked below.
        subprocess.run([npm, "install", "--no-audit", "--no-fund"], cwd=CLI_DIR, check=True, timeout=600)
    # The binaries themselves run here and are the pinned releases.
    env = {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.path.dirname(node), os.environ.get("PATH", "")])}
    for name, package in BINARIES.items():
        shown = subprocess.run([bin_dir / name, "--version"], capture_output=True, text=True, timeout=60, env=env)
        # (pi prints its version on stderr)
        assert PINNED[package] in shown.stdout + shown.stderr, (name, shown.returncode, shown.stdout, shown.stderr)
    return bin_dir


def steered_replica(network: Network, preferred_tools: dict[str, dict[str, Any]], **config: Any) -> NamespacedReplica:
    """The Qwen3 replica in the namespace, steered to call the CLI's shell tool TOOL_ROUNDS times per prompt."""
    steered = ReplicaConfig(
        tokenizer=tokenizer_path("qwen3"), preferred_tools=preferred_tools, tool_rounds=TOOL_ROUNDS, **config
    )
    return NamespacedReplica(steered, network)


def namespaced_proxy(network: Network, replica: ReplicaThread, tmp_path: Path, **options: Any) -> Mitmdump:
    """A mitmdump in the namespace recording to tmp_path/rec, its options as given; the replica's log emptied."""
    replica.backend.reset()
    return Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path,
                    launcher=network.command([]), options=options or None)  # fmt: skip


def keyed_proxy(network: Network, replica: ReplicaThread, tmp_path: Path) -> Mitmdump:
    """`namespaced_proxy` whose API keys `KEY_PREFIX + EPISODE` name episodes, the backend's own key BACKEND_KEY."""
    return namespaced_proxy(network, replica, tmp_path, tito_session_api_key_prefix=KEY_PREFIX,
                            tito_backend_api_key=BACKEND_KEY)  # fmt: skip


@dataclass
class CliRun:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def events(self) -> list[dict[str, Any]]:
        """The JSON lines of stdout (the CLIs' JSON modes print one event per line)."""
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
    node_dir = os.path.dirname(shutil.which("node") or "/usr/bin/node")  # the launchers are `#!/usr/bin/env node`
    path = os.pathsep.join([str(bin_dir), node_dir, "/usr/local/bin", "/usr/bin", "/bin"])
    return {"PATH": path, "HOME": str(home), "SHELL": "/bin/bash", "LANG": "C.UTF-8", **extra}


# ---------------------------------------------------------------------------------------------- assertions


def text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content or "")


def chains_of(session: Any) -> list[list]:
    """A recorded session's turns, one list per root: the turns that descend from it, in record order."""
    roots: dict[int, int] = {}  # turn id -> its root's
    chains: dict[int, list] = {}
    for turn in session.turns:
        root = turn.turn_id if turn.parent_turn_id is None else roots[turn.parent_turn_id]
        roots[turn.turn_id] = root
        chains.setdefault(root, []).append(turn)
    return list(chains.values())


def assert_exact_chain(
    proxy: Mitmdump, replica: ReplicaThread, api: str, printed: str, *, invocations: int = 1, side_calls: bool = False
) -> list:
    """The CLI's main chain (the one root whose turns call tools) is one line of turns in which every request extends
    the previous turn's exact ids, holding TOOL_ROUNDS real tool round trips per invocation (each result holding what
    the shell `printed`) and then the answer that ended it; a later invocation continues the earlier one. Every other
    recorded turn (a title or summary side call, in a session of its own or the main chain's, allowed only with
    `side_calls`) is token exact too and calls no tool. Returns the main chain's turns."""
    # Nothing was refused or failed on the way: a CLI retries a failed request, which would hide it from the records.
    refused = re.findall(r"<< ([45]\d\d\b.*)", proxy.output())
    assert not refused, (refused, proxy.output()[-6000:])
    assert_token_exact(proxy.record_dir, replica)  # ids on disk == ids the replica got and generated, every session
    chains = [(f, chain) for f in iter_session_files(proxy.record_dir) for chain in chains_of(f)]
    mains = [(f, chain) for f, chain in chains if any(t.finish_reason == "tool_calls" for t in chain)]
    assert len(mains) == 1, [(f.path.name, [t.finish_reason for t in chain]) for f, chain in chains]
    (main, turns), sides = mains[0], [chain for _, chain in chains if chain is not mains[0][1]]
    assert side_calls or not sides, [[t.turn_id for t in chain] for chain in sides]
    assert all(turn.api == api for turn in turns), {turn.api for turn in turns}
    # A line: each turn's parent is the turn before it (the previous request of the agent, nothing branched).
    assert [t.parent_turn_id for t in turns] == [None, *[t.turn_id for t in turns[:-1]]]
    # Independently of the records: each prompt of the chain the replica received starts with the previous prompt +
    # completion (the replica's own log, in the order it answered, the side calls' entries left out).
    ids = main.full_ids()
    chain_prompts = {tuple(ids[t.turn_id][0]) for t in turns}
    generated = [g for g in replica.generated() if tuple(g["prompt_ids"]) in chain_prompts]
    assert len(generated) == len(turns)
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
    assert round_trips == invocations * TOOL_ROUNDS >= 2, [t.finish_reason for t in turns]
    # Each invocation: TOOL_ROUNDS tool turns, then the answer that ended it; the next hangs off that answer.
    assert [t.finish_reason for t in turns] == (["tool_calls"] * TOOL_ROUNDS + ["stop"]) * invocations
    for chain in sides:
        assert all(t.finish_reason != "tool_calls" for t in chain), [t.turn_id for t in chain]
    return turns


def assert_backend_saw_only_its_key(proxy: Mitmdump, replica: ReplicaThread, episode: str) -> None:
    """Behind a `keyed_proxy`: every request the backend got carries its own key as `Authorization: Bearer` (what
    sglang's and vLLM's `--api-key` read), whichever header the agent put its episode key in, and no other key header;
    the episode's key is in no proxy log or recorded file."""
    backend_key, episode_key = BACKEND_KEY, KEY_PREFIX + episode
    headers = [{k.lower(): v for k, v in h.items()} for h in replica.backend.received_headers]
    assert len(headers) == len(replica.received())
    keys = [{name: h[name] for name in ("authorization", "x-api-key", "x-goog-api-key") if name in h} for h in headers]
    assert keys == [{"authorization": f"Bearer {backend_key}"}] * len(headers), keys
    assert episode_key not in proxy.output()
    for path in proxy.record_dir.rglob("*"):
        assert not path.is_file() or episode_key.encode() not in path.read_bytes(), path
