"""A rollout driver: N samples of each task, run as concurrent episodes of an unmodified agent through a tito proxy,
each scored by a reward function and given its task as its GRPO group; the token-exact rows of all of them fetched
from the proxy's control API as one export (each group's rows together) and written to one Parquet file a trainer
loads.

The agent is never changed; each episode is named by the settings the driver gives it:
- `--agent openai` (examples/weather_agent.py, openai-python): the proxy in regular mode, the episode as the proxy's
  user name: `HTTP_PROXY=HTTPS_PROXY=http://EPISODE@PROXY_HOST:PORT`, `OPENAI_BASE_URL` the backend's own URL;
- `--agent claude-code`: the proxy in reverse mode in front of the backend, the episode in the API key:
  `ANTHROPIC_BASE_URL=http://PROXY_HOST:PORT`, `ANTHROPIC_API_KEY=<tito_session_api_key_prefix>EPISODE`
  (the proxy swaps it for `tito_backend_api_key`).

Start the proxy (`tito_control_token` on), then for example:

    python examples/rollout_driver.py --proxy http://127.0.0.1:8080 --token $TITO_CONTROL_TOKEN \
        --base-url http://127.0.0.1:30000/v1 --samples 8 --out rollouts.parquet --format verl \
        --tasks-file examples/weather_tasks.jsonl --reward episode_rewards:matches_ground_truth

Safe to run again: episode names are `PREFIX-0000`, `PREFIX-0001`, … with a fresh prefix each run
(`run-YYYYMMDD-HHMMSS-XXXX`, printed); an explicit `--prefix` whose names the proxy already knows is refused before
any agent starts (exit 2). Before the first agent the driver also checks that the proxy answers, takes the token,
serves the control API, and (claude-code) names episodes by `--key-prefix`. It only ever scores, closes and exports
sessions this run created.

Per episode: run the agent, wait until the proxy has no turn of it in flight, score it, attach the score and its
task's group (`annotations`: reward, labels, metadata, group), close the episode. An agent that fails (non-zero exit
or timeout; its reason printed) or a reward that fails makes the episode failed: it gets no reward, is closed and is
left out of the export (its group is then short: left out with `--group-policy drop`). Then one rows call for the
good episodes: groups contiguous, `uid`/`group_index` the task, `rollout_id` the episode, `index` the row. The file
loads as it is: `datasets.Dataset.from_parquet(OUT)`, `tito_addon.trainers.verl_batch.verl_batch(OUT)` (verl
layout), or `python -m tito_addon.trainers.slime_rollouts OUT DIR` (slime layout). Exit status: 0 when every episode
succeeded, 1 when any failed (the good ones still exported), 2 when nothing ran (a bad setting, a preflight refusal).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import json
import math
import os
import secrets
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, ValidationError

from tito_addon.client import AsyncTitoClient, TitoControlError, episode_api_key, episode_proxy_url

HERE = Path(__file__).resolve().parent
DEFAULT_TASKS = [
    "What's the weather in Paris?", "Is it warm in Lima today?", "Weather in Oslo, please.", "How is Rome?",
]  # fmt: skip
TASK_LINE = '{"prompt": str, "ground_truth"?: any, "metadata"?: object, "id"?: str}'
DEFAULT_REWARD = "episode_rewards:tool_use"
REASON_CHARS = 500  # of an agent's output, when it names no error of its own


class Refused(Exception):
    """A setting or preflight check that stops the run before any agent starts (exit 2, nothing written)."""


class Task(BaseModel):
    """One line of `--tasks-file`."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1)
    ground_truth: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(default=None, min_length=1, max_length=200)


class RewardReply(BaseModel):
    """What `--reward-command` may print as JSON (a bare number is read as `{"reward": number}`)."""

    model_config = ConfigDict(extra="forbid")
    reward: StrictFloat | StrictInt
    labels: list[str] = Field(default_factory=list, max_length=64)


@dataclass
class Episode:
    name: str
    task: Task
    group: str
    returncode: int | None = None
    outcome: dict[str, Any] | None = None
    failure: str | None = None  # why the episode has no reward (the agent's or the reward's error)
    recorded: bool = False  # the proxy has a session of this name (the agent's first turn reached it)
    reward: float | None = None
    labels: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- tasks and rewards


def load_tasks(path: Path | None, count: int | None) -> list[tuple[str, Task]]:
    """(group, task) pairs: the file's lines (group: its `id`, else `task-N` by line), or the built-in list."""
    if path is None:
        tasks = [(f"task-{i}", Task(prompt=prompt)) for i, prompt in enumerate(DEFAULT_TASKS)]
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise Refused(f"--tasks-file {path}: cannot read it: {error}") from None
        tasks = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                task = Task.model_validate_json(line)
            except ValidationError as error:
                problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in error.errors())
                raise Refused(f"--tasks-file {path}:{number}: not a task ({problems}); a line is {TASK_LINE}") from None
            tasks.append((task.id or f"task-{len(tasks)}", task))
        if not tasks:
            raise Refused(f"--tasks-file {path}: no tasks in it")
        groups = [group for group, _ in tasks]
        repeated = sorted({g for g in groups if groups.count(g) > 1})
        if repeated:
            raise Refused(f"--tasks-file {path}: task ids used twice: {', '.join(repeated)} (an id is a GRPO group)")
    if count is not None:
        if not 0 < count <= len(tasks):
            raise Refused(f"--tasks {count}: there are {len(tasks)} tasks")
        tasks = tasks[:count]
    return tasks


def load_reward(spec: str) -> Callable[[dict[str, Any]], Any]:
    """`MODULE:FUNCTION` (imported; examples/ and the working directory are on the path) or `FILE.py:FUNCTION`."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise Refused(f"--reward {spec!r}: expected MODULE_OR_FILE:FUNCTION")
    try:
        if where.endswith(".py") or os.sep in where:
            loaded = importlib.util.spec_from_file_location(f"tito_reward_{Path(where).stem}", where)
            if loaded is None or loaded.loader is None or not Path(where).is_file():
                raise Refused(f"--reward {spec!r}: no such file {where}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            for folder in (str(HERE), os.getcwd()):
                if folder not in sys.path:
                    sys.path.append(folder)
            module = importlib.import_module(where)
    except Refused:
        raise
    except Exception as error:  # the user's module failed to import: say so, no traceback
        raise Refused(f"--reward {spec!r}: cannot load {where}: {type(error).__name__}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise Refused(f"--reward {spec!r}: {where} has no function {name}")
    return function


def reward_input(episode: Episode) -> dict[str, Any]:
    outcome = episode.outcome or {}
    return {
        "episode": episode.name, "group": episode.group, "prompt": episode.task.prompt,
        "ground_truth": episode.task.ground_truth, "metadata": episode.task.metadata, "answer": outcome.get("answer"),
        "outcome": outcome, "exit_code": episode.returncode,
    }  # fmt: skip


def checked_reward(value: Any) -> tuple[float, list[str]]:
    """A float, or (float, labels): anything else is refused, never guessed at."""
    reward, labels = value if isinstance(value, tuple) and len(value) == 2 else (value, [])
    reply = RewardReply.model_validate({"reward": reward, "labels": [] if labels is None else labels})
    if not math.isfinite(reply.reward):
        raise ValueError(f"reward {reply.reward} is not finite")
    return float(reply.reward), reply.labels


async def score_by_command(command: str, data: dict[str, Any], timeout_s: float) -> tuple[float, list[str]]:
    process = await asyncio.create_subprocess_shell(
        command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(json.dumps(data).encode()), timeout=timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise ValueError(f"--reward-command took more than {timeout_s:g} s") from None
    if process.returncode != 0:
        raise ValueError(f"--reward-command exited {process.returncode}: {tail(err.decode(errors='replace'))}")
    text = out.decode(errors="replace").strip()
    try:
        parsed = json.loads(text)
    except ValueError:
        raise ValueError(f"--reward-command printed {text[:200]!r}, not a number or a JSON object") from None
    if isinstance(parsed, dict):
        try:
            reply = RewardReply.model_validate(parsed)
        except ValidationError as error:
            raise ValueError(f"--reward-command printed {text[:200]!r}: {error.errors()[0]['msg']}") from None
        return checked_reward((reply.reward, reply.labels))
    return checked_reward(parsed)


# ---------------------------------------------------------------------------------------------- agents


def tail(text: str, limit: int = REASON_CHARS) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    joined = " | ".join(lines[-6:])
    return joined[-limit:]


def agent_command(args: argparse.Namespace, episode: Episode, scratch: Path) -> tuple[list[str], dict[str, str]]:
    """The unmodified agent's argv and environment for one episode: only its usual settings name the episode."""
    base = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    prompt = episode.task.prompt
    if args.agent == "openai":
        proxy = episode_proxy_url(args.proxy, episode.name, args.proxy_password)
        env = {**base, "OPENAI_BASE_URL": args.base_url, "OPENAI_API_KEY": args.api_key or "unused",
               "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "NO_PROXY": ""}  # fmt: skip
        argv = [sys.executable, str(HERE / "weather_agent.py"), prompt, "--max-steps", str(args.max_steps),
                "--model", args.model]  # fmt: skip
        return argv, env
    home = scratch / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": args.proxy, "ANTHROPIC_API_KEY": episode_api_key(args.key_prefix, episode.name),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }  # fmt: skip
    argv = [*shlex.split(args.claude), "-p", prompt, "--allowedTools", "Bash", "--output-format", "stream-json",
            "--verbose", "--model", args.model]  # fmt: skip
    return argv, env


def claude_outcome(stdout: str) -> tuple[dict[str, Any] | None, str | None]:
    """Claude Code's stream-json: its final `result` event says how the episode ended, and with `is_error` its
    `result` is the error it stopped on (an API error's own text)."""
    events = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    results = [e for e in events if isinstance(e, dict) and e.get("type") == "result"]
    if not results:
        return None, None
    tool_calls = sum(
        1
        for e in events
        if e.get("type") == "assistant"
        for block in (e.get("message") or {}).get("content") or []
        if isinstance(block, dict) and block.get("type") == "tool_use"
    )
    final = results[-1]
    ok = final.get("subtype") == "success" and not final.get("is_error")
    outcome = {"finish_reason": "stop" if ok else "error", "answer": final.get("result"), "tool_calls": tool_calls,
               "tool_errors": 0}  # fmt: skip
    error = None if ok else str(final.get("result") or final.get("subtype") or "an error result without text")
    return outcome, error


async def run_agent(args: argparse.Namespace, episode: Episode) -> None:
    with tempfile.TemporaryDirectory(prefix=f"{episode.name}-") as scratch:
        argv, env = agent_command(args, episode, Path(scratch))
        try:
            process = await asyncio.create_subprocess_exec(
                *shlex.split(args.launcher), *argv, env=env, cwd=scratch, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        except OSError as error:
            episode.failure = f"the agent did not start: {argv[0]}: {error}"
            return
        try:
            stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=args.agent_timeout)
        except TimeoutError:
            # The whole process group: a tool the agent started would otherwise hold its pipes open.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = await process.communicate()
            episode.failure = f"timed out after {args.agent_timeout:g} s; its last output: " + (
                tail(stderr.decode(errors="replace") or stdout.decode(errors="replace")) or "none"
            )
            return
    episode.returncode = process.returncode
    out, err = stdout.decode(errors="replace"), stderr.decode(errors="replace")
    error = None
    if args.agent == "openai":
        lines = [line for line in out.splitlines() if line.startswith("{")]
        with contextlib.suppress(ValueError):
            episode.outcome = json.loads(lines[-1]) if lines else None
    else:
        episode.outcome, error = claude_outcome(out)
    # An error the agent stopped on (Claude Code's API error) fails the episode whatever its exit status: it says
    # nothing of the model, so it is no 0 to train on.
    if episode.returncode != 0 or episode.outcome is None or error is not None:
        reason = error or tail(err) or tail(out) or "it printed nothing"
        episode.failure = f"exit {episode.returncode}: {reason}"


async def run_episode(
    args: argparse.Namespace, tito: AsyncTitoClient, episode: Episode, reward: Callable[[Episode], Any]
) -> None:
    await run_agent(args, episode)
    # The agent has exited, but a turn it abandoned may still be running in the proxy: never read mid-turn. A 404:
    # no turn of it ever reached the proxy, so there is no session to score or close.
    try:
        idle = await tito.wait_idle(episode.name, timeout_s=min(args.agent_timeout, 600))
    except TitoControlError as error:
        if error.status != 404:
            raise
        episode.failure = (episode.failure or "the agent exited 0") + "; no turn was recorded, so it has no session"
        return
    episode.recorded = True
    if not idle:
        still = "a turn of it is still in flight in the proxy: not scored or closed"
        episode.failure = f"{episode.failure}; {still}" if episode.failure else still
        return  # never closed mid-turn: its record would lose that turn
    if episode.failure is None:
        try:
            episode.reward, episode.labels = await reward(episode)
        except Exception as error:  # the user's reward: its failure is the episode's, said, never a traceback
            episode.failure = f"reward failed: {type(error).__name__}: {error}"
    metadata = {"task": episode.task.prompt, "task_id": episode.group, **(episode.outcome or {})}
    if episode.task.metadata:
        metadata["task_metadata"] = episode.task.metadata
    if episode.failure is None:
        await tito.annotate(episode.name, reward=episode.reward, labels=episode.labels, metadata=metadata,
                            group=episode.group)  # fmt: skip
    else:  # said why, with no reward: no trainer may read it as a score
        metadata["failure"] = episode.failure[:2000]
        await tito.annotate(episode.name, labels=["failed"], metadata=metadata, group=episode.group)
    await tito.close(episode.name)


# ---------------------------------------------------------------------------------------------- preflight


async def preflight(args: argparse.Namespace, tito: AsyncTitoClient, names: list[str]) -> dict[str, Any]:
    """Everything that would make every episode fail, or touch another run's sessions, checked before any agent."""
    control = args.control_proxy or args.proxy
    flag = "--control-proxy" if args.control_proxy else "--proxy"
    # First without the token: a proxy serving the control API answers any such call 401. One that does not serve it
    # (no tito_control_token) passes the request on to wherever it was going (a 502 in regular mode, the backend's
    # own answer in reverse mode), so the token is never sent anywhere before the control host is known to be there.
    try:
        async with AsyncTitoClient(control, "", timeout_s=30.0) as anonymous:
            await anonymous.info()
        served, answer = False, "200 without a token"
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise Refused(f"cannot reach the proxy at {control} ({flag}): {type(error).__name__}: {error}") from None
    except TitoControlError as error:
        served, answer = error.status == 401, f"{error.status}: {error.message[:200]}"
    except ValueError:
        served, answer = False, "200, not JSON"
    if not served:
        raise Refused(
            f"the proxy at {control} does not serve the control API (GET http://tito.control/v1/info got {answer}): "
            "start it with `--set tito_control_token=TOKEN` (at least 16 characters) and pass that TOKEN as --token"
        )
    try:
        info = await tito.info()
    except TitoControlError as error:
        if error.status == 401:
            raise Refused(
                f"the proxy at {control} refused the control token (401): give the value the proxy was started with "
                "(`--set tito_control_token=…`) as --token or $TITO_CONTROL_TOKEN"
            ) from None
        raise Refused(f"the proxy at {control} answered GET /v1/info with {error} (an older tito_addon?)") from None
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        raise Refused(f"GET /v1/info through {control} failed: {type(error).__name__}: {error}") from None
    if not isinstance(info, dict) or "after_close" not in info:
        raise Refused(f"{control} answered GET /v1/info with {str(info)[:200]}: not a tito control API (or an old one)")
    if args.agent == "claude-code" and info.get("session_api_key_prefix") != args.key_prefix:
        raise Refused(
            f"the proxy names episodes by API keys starting {info.get('session_api_key_prefix')!r} "
            f"(tito_session_api_key_prefix), the driver would send {args.key_prefix!r} (--key-prefix): start the "
            f"proxy with `--set tito_session_api_key_prefix={args.key_prefix}` or pass --key-prefix with its value"
        )
    if args.agent == "openai" and info.get("proxy_auth_password_required") and not args.proxy_password:
        raise Refused("the proxy requires a proxy-auth password (tito_proxy_auth_password): pass --proxy-password")
    gate = asyncio.Semaphore(16)

    async def taken(name: str) -> bool:
        async with gate:
            try:
                await tito.session(name)
            except TitoControlError as error:
                if error.status == 404:
                    return False
                raise
            return True

    used = [name for name, is_taken in zip(names, await asyncio.gather(*(taken(n) for n in names)), strict=True)
            if is_taken]  # fmt: skip
    if used:
        shown = ", ".join(used[:8]) + (f" and {len(used) - 8} more" if len(used) > 8 else "")
        raise Refused(
            f"{len(used)} of this run's {len(names)} episode names are already sessions of the proxy ({shown}): "
            f"another run used prefix {args.prefix!r}. Nothing was run. Pick an unused --prefix, or leave --prefix "
            "out for a fresh one; the earlier run's sessions are left as they are"
        )
    return info


# ---------------------------------------------------------------------------------------------- the run


def zero_variance_warnings(episodes: list[Episode]) -> list[str]:
    rewards: dict[str, list[float]] = {}
    for episode in episodes:
        if episode.failure is None and episode.reward is not None:
            rewards.setdefault(episode.group, []).append(episode.reward)
    # A group of one has no spread to compare: it says nothing about the rest.
    groups = {group: values for group, values in rewards.items() if len(values) > 1}
    flat = [group for group, values in groups.items() if statistics.pvariance(values) == 0]
    if groups and len(flat) == len(groups):
        return [f"WARNING: every group's rewards are equal within the group ({len(groups)} groups): GRPO advantages "
                "are all 0, so a step on this batch would train nothing. Check the reward (--reward/--reward-command) "
                "and the tasks"]  # fmt: skip
    if flat:
        return [f"WARNING: {len(flat)} of {len(groups)} groups have zero reward variance (their GRPO advantages are "
                f"0, they train nothing): {', '.join(flat)}"]  # fmt: skip
    return []


async def drive(args: argparse.Namespace, episodes: list[Episode], reward: Callable[[Episode], Any]) -> dict[str, Any]:
    names = [e.name for e in episodes]
    async with AsyncTitoClient(args.control_proxy or args.proxy, args.token, timeout_s=660.0) as tito:
        info = await preflight(args, tito, names)
        print(f"proxy: tito_addon {info.get('version')}, backend {info.get('backend_kind')}, tokenizer "
              f"{info.get('tokenizer')}; episodes {names[0]} … {names[-1]}", flush=True)  # fmt: skip
        gate = asyncio.Semaphore(args.concurrency)

        async def one(episode: Episode) -> None:
            async with gate:
                await run_episode(args, tito, episode, reward)

        await asyncio.gather(*(one(e) for e in episodes))
        for episode in episodes:
            if episode.failure is not None:
                print(f"{episode.name}: failed: {episode.failure}", file=sys.stderr)
        for line in zero_variance_warnings(episodes):
            print(line, file=sys.stderr)
        good = [e.name for e in episodes if e.failure is None]
        if not good:
            return {"rows": 0, "groups": [], "dropped_groups": 0, "written": False}
        # One export of the good episodes: rows of a group together, numbered across all of them. An episode may
        # have several segments (a compaction, a sub-agent): a group's size is counted in rows.
        size = args.samples if args.group_size is None else (args.group_size or None)
        options = {"format": args.format, "group_size": size, "group_policy": args.group_policy}
        summary = await tito.export_rows(good, to="summary", **options)
        data = await tito.export_rows(good, to="parquet", **options)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    partial = args.out.with_name(args.out.name + ".partial")
    partial.write_bytes(data)
    partial.replace(args.out)  # never a half-written file under the name a trainer reads
    return {**summary, "written": True}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default shown, except an unset one (its help says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def parse(argv: list[str] | None) -> argparse.Namespace:
    default_tasks = "; ".join(f"task-{i}: {t!r}" for i, t in enumerate(DEFAULT_TASKS))
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog=f"Built-in tasks (without --tasks-file): {default_tasks}. The default reward, {DEFAULT_REWARD} "
        "(examples/episode_rewards.py): 1 for a tool used then an answer, 0.5 for an answer alone, 0 otherwise. "
        "Exit status: 0 all episodes good, 1 some failed (the good ones exported), 2 nothing run.",
    )  # fmt: skip
    parser.add_argument("--proxy", required=True, help="the tito proxy, http://HOST:PORT")
    # Read from the environment after parsing: a default would print the secret in --help.
    parser.add_argument("--token", help="the proxy's tito_control_token (default: $TITO_CONTROL_TOKEN)")
    parser.add_argument("--agent", choices=("openai", "claude-code"), default="openai", help="the agent to run")
    parser.add_argument("--model", default="qwen3", help="the model name the agent sends (its --model)")
    parser.add_argument("--base-url", help="openai: the backend's own base URL (the proxy intercepts it)")
    parser.add_argument("--api-key", default="", help="openai: the backend's API key, if it needs one")
    parser.add_argument("--proxy-password", default=None, help="the proxy's tito_proxy_auth_password, if set")
    parser.add_argument("--key-prefix", default="sk-tito-", help="claude-code: the proxy's tito_session_api_key_prefix")
    parser.add_argument("--claude", default="claude", help="claude-code: the CLI to run (an argv prefix)")
    parser.add_argument("--control-proxy", help="where the control API is, if not --proxy (any port of the proxy)")
    parser.add_argument("--launcher", default="", help="an argv prefix for the agent, e.g. 'nsenter --net=PATH'")
    parser.add_argument("--tasks-file", type=Path, help=f"JSONL, a task a line: {TASK_LINE}; its group is its id, "
                        "else task-N (N: its place; default: the built-in tasks below)")  # fmt: skip
    parser.add_argument("--tasks", type=int, help="use the first N tasks (default: all of them)")
    parser.add_argument("--samples", type=int, default=2, help="episodes per task (n_samples_per_prompt)")
    rewards = parser.add_mutually_exclusive_group()
    rewards.add_argument("--reward", default=DEFAULT_REWARD, help="MODULE_OR_FILE:FUNCTION taking the episode's dict "
                         "(prompt, ground_truth, metadata, answer, outcome, exit_code, episode, group), returning "
                         "a float or (float, labels); see examples/episode_rewards.py")  # fmt: skip
    rewards.add_argument("--reward-command", help="a shell command run per episode, the same dict as JSON on stdin; "
                         'it prints a number or {"reward": x, "labels": [...]}')  # fmt: skip
    parser.add_argument("--reward-timeout", type=float, default=60.0, help="seconds one --reward-command may take")
    parser.add_argument("--group-size", type=int, help="rows each group must have (default: --samples; 0: any)")
    parser.add_argument("--group-policy", choices=("refuse", "drop", "pad"), default="drop",
                        help="a group of another size than --group-size: refused, left out or padded")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=4, help="episodes run at once")
    parser.add_argument("--max-steps", type=int, default=6, help="openai: the agent's tool-loop steps")
    parser.add_argument("--agent-timeout", type=float, default=300.0, help="seconds one agent may run")
    parser.add_argument("--prefix", help="episode names PREFIX-0000, …; every one must be unused (default: a fresh "
                        "run-YYYYMMDD-HHMMSS-XXXX each run)")  # fmt: skip
    parser.add_argument("--format", choices=("generic", "verl", "slime", "verl-dataset"), default="generic",
                        help="the rows' layout (see README, Export layouts)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("rollouts.parquet"), help="the Parquet file written")
    args = parser.parse_args(argv)
    args.token = args.token or os.environ.get("TITO_CONTROL_TOKEN")
    if not args.token:
        parser.error("--token (or $TITO_CONTROL_TOKEN) is required: the proxy's tito_control_token")
    if args.agent == "openai" and not args.base_url:
        parser.error("--base-url is required with --agent openai")
    if args.samples < 1 or args.concurrency < 1:
        parser.error("--samples and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        tasks = load_tasks(args.tasks_file, args.tasks)
        if args.reward_command:
            command, timeout_s = args.reward_command, args.reward_timeout

            async def reward(episode: Episode) -> tuple[float, list[str]]:
                return await score_by_command(command, reward_input(episode), timeout_s)
        else:
            function = load_reward(args.reward)

            async def reward(episode: Episode) -> tuple[float, list[str]]:
                return checked_reward(function(reward_input(episode)))
    except Refused as refused:
        print(f"rollout_driver: {refused}", file=sys.stderr)
        return 2
    if args.prefix is None:
        args.prefix = time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)
        print(f"run prefix: {args.prefix}", flush=True)
    episodes = [
        Episode(f"{args.prefix}-{t * args.samples + k:04d}", task, group)
        for t, (group, task) in enumerate(tasks)
        for k in range(args.samples)
    ]
    try:
        summary = asyncio.run(drive(args, episodes, reward))
    except Refused as refused:
        print(f"rollout_driver: {refused}", file=sys.stderr)
        return 2
    except (TitoControlError, aiohttp.ClientError, TimeoutError) as error:
        print(f"rollout_driver: the control API failed mid-run: {type(error).__name__}: {error}; nothing was "
              f"written to {args.out}", file=sys.stderr)  # fmt: skip
        return 1
    failed = [e for e in episodes if e.failure is not None]
    scored = [e.reward for e in episodes if e.reward is not None and e.failure is None]
    mean = f"{sum(scored) / len(scored):.3f}" if scored else "n/a"
    if summary["written"]:
        kept = [g for g in summary["groups"] if g["group_index"] is not None]
        print(f"{len(episodes)} episodes ({len(failed)} failed), mean reward {mean}, {summary['rows']} rows in "
              f"{len(kept)} groups in {args.out}; {summary['dropped_groups']} groups left out")  # fmt: skip
    else:
        print(f"{len(episodes)} episodes, every one failed: nothing written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
