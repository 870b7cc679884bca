"""A rollout driver: N samples of each task, run as concurrent episodes of an unmodified agent through a tito proxy,
each scored by a rule and given its task as its GRPO group; the token-exact rows of all of them fetched from the
proxy's control API as one export (each group's rows together) and written to one Parquet file a trainer loads.

The agent is never changed; each episode is named by the settings the driver gives it:
- `--agent openai` (examples/weather_agent.py, openai-python): the proxy in regular mode, the episode as the proxy's
  user name: `HTTP_PROXY=HTTPS_PROXY=http://EPISODE@PROXY_HOST:PORT`, `OPENAI_BASE_URL` the backend's own URL;
- `--agent claude-code`: the proxy in reverse mode in front of the backend, the episode in the API key:
  `ANTHROPIC_BASE_URL=http://PROXY_HOST:PORT`, `ANTHROPIC_API_KEY=<tito_session_api_key_prefix>EPISODE`
  (the proxy swaps it for `tito_backend_api_key`).

Start the proxy (`tito_control_token` on), then for example:

    python examples/rollout_driver.py --proxy http://127.0.0.1:8080 --token $TITO_CONTROL_TOKEN \
        --base-url http://127.0.0.1:30000/v1 --tasks 4 --samples 8 --concurrency 16 --out rollouts.parquet --format verl

Per episode: run the agent, wait until the proxy has no turn of it in flight, score it, attach the score and its
task's group (`annotations`: reward, labels, metadata, group), close the episode. Then one rows call for every
episode: groups contiguous, `uid`/`group_index` the task, `rollout_id` the episode, `index` the row, each group
`--samples` rows long (a group that lost an episode is left out and said so). The file loads as it is:
`datasets.Dataset.from_parquet(OUT)`, `tito_addon.trainers.verl_batch.verl_batch(OUT)` (verl layout), or
`python -m tito_addon.trainers.slime_rollouts OUT DIR` (slime layout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito_addon.client import AsyncTitoClient, episode_api_key, episode_proxy_url

HERE = Path(__file__).resolve().parent
TASKS = ["What's the weather in Paris?", "Is it warm in Lima today?", "Weather in Oslo, please.", "How is Rome?"]


@dataclass
class Episode:
    name: str
    task: str
    group: str
    returncode: int = -1
    outcome: dict[str, Any] | None = None
    stderr: str = ""


def score(episode: Episode) -> tuple[float, list[str]]:
    """The rule: 1 for an agent that used its tool without errors and then answered; 0.5 for an answer without a
    tool call; 0 for a crash, an unfinished episode or a tool error."""
    outcome = episode.outcome
    if episode.returncode != 0 or outcome is None:
        return 0.0, ["crashed"]
    if outcome.get("finish_reason") != "stop" or not outcome.get("answer"):
        return 0.0, ["unfinished"]
    if outcome.get("tool_errors"):
        return 0.0, ["tool_error"]
    if outcome.get("tool_calls"):
        return 1.0, ["tool_used", "answered"]
    return 0.5, ["answered"]


def agent_command(args: argparse.Namespace, episode: Episode, scratch: Path) -> tuple[list[str], dict[str, str]]:
    """The unmodified agent's argv and environment for one episode: only its usual settings name the episode."""
    base = {k: v for k, v in os.environ.items() if not k.upper().endswith("_PROXY")}
    if args.agent == "openai":
        proxy = episode_proxy_url(args.proxy, episode.name, args.proxy_password)
        env = {**base, "OPENAI_BASE_URL": args.base_url, "OPENAI_API_KEY": args.api_key or "unused",
               "HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "NO_PROXY": ""}  # fmt: skip
        argv = [sys.executable, str(HERE / "weather_agent.py"), episode.task, "--max-steps", str(args.max_steps)]
        return argv, env
    home = scratch / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": args.proxy, "ANTHROPIC_API_KEY": episode_api_key(args.key_prefix, episode.name),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }  # fmt: skip
    argv = [args.claude, "-p", episode.task, "--allowedTools", "Bash", "--output-format", "stream-json", "--verbose"]
    return argv, env


def claude_outcome(stdout: str) -> dict[str, Any] | None:
    """Claude Code's stream-json: its final `result` event says how the episode ended."""
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    results = [e for e in events if e.get("type") == "result"]
    if not results:
        return None
    tool_calls = sum(
        1
        for e in events
        if e.get("type") == "assistant"
        for block in (e.get("message") or {}).get("content") or []
        if block.get("type") == "tool_use"
    )
    final = results[-1]
    finish = "stop" if final.get("subtype") == "success" and not final.get("is_error") else "error"
    return {"finish_reason": finish, "answer": final.get("result"), "tool_calls": tool_calls, "tool_errors": 0}


async def run_episode(args: argparse.Namespace, tito: AsyncTitoClient, episode: Episode) -> None:
    with tempfile.TemporaryDirectory(prefix=f"{episode.name}-") as scratch:
        argv, env = agent_command(args, episode, Path(scratch))
        process = await asyncio.create_subprocess_exec(
            *shlex.split(args.launcher), *argv, env=env, cwd=scratch, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=args.agent_timeout)
    episode.returncode, episode.stderr = process.returncode or 0, stderr.decode(errors="replace")[-2000:]
    text = stdout.decode(errors="replace")
    if args.agent == "openai":
        lines = [line for line in text.splitlines() if line.startswith("{")]
        episode.outcome = json.loads(lines[-1]) if lines else None
    else:
        episode.outcome = claude_outcome(text)
    # The agent has exited, but a turn it abandoned may still be running in the proxy: never read mid-turn.
    if not await tito.wait_idle(episode.name, timeout_s=args.agent_timeout):
        raise RuntimeError(f"{episode.name}: a turn is still in flight")
    reward, labels = score(episode)
    metadata = {"task": episode.task, **(episode.outcome or {})}
    await tito.annotate(episode.name, reward=reward, labels=labels, metadata=metadata, group=episode.group)
    await tito.close(episode.name)


async def drive(args: argparse.Namespace) -> tuple[list[Episode], dict[str, Any]]:
    episodes = [
        Episode(f"{args.prefix}-{task * args.samples + k:04d}", TASKS[task % len(TASKS)], f"task-{task}")
        for task in range(args.tasks)
        for k in range(args.samples)
    ]
    gate = asyncio.Semaphore(args.concurrency)
    async with AsyncTitoClient(args.control_proxy or args.proxy, args.token) as tito:

        async def one(episode: Episode) -> None:
            async with gate:
                await run_episode(args, tito, episode)

        await asyncio.gather(*(one(e) for e in episodes))
        # One export of every episode: rows of a group together, numbered across all of them. An episode that
        # crashed before its first turn has no rows: its group is short and left out rather than trained unequal.
        names = [e.name for e in episodes]
        # An episode may have several segments (a compaction, a sub-agent): a group's size is counted in rows.
        size = args.samples if args.group_size is None else (args.group_size or None)
        options = {"format": args.format, "group_size": size, "group_policy": args.group_policy}
        summary = await tito.export_rows(names, to="summary", **options)
        data = await tito.export_rows(names, to="parquet", **options)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    return episodes, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--proxy", required=True, help="the tito proxy, http://HOST:PORT")
    parser.add_argument("--token", default=os.environ.get("TITO_CONTROL_TOKEN"), help="its tito_control_token")
    parser.add_argument("--agent", choices=("openai", "claude-code"), default="openai")
    parser.add_argument("--base-url", help="openai: the backend's own base URL (the proxy intercepts it)")
    parser.add_argument("--api-key", default="", help="openai: the backend's API key, if it needs one")
    parser.add_argument("--proxy-password", default=None, help="the proxy's tito_proxy_auth_password, if set")
    parser.add_argument("--key-prefix", default="sk-tito-", help="claude-code: the proxy's tito_session_api_key_prefix")
    parser.add_argument("--claude", default="claude", help="claude-code: the CLI to run")
    parser.add_argument("--control-proxy", help="where the control API is, if not --proxy (any port of the proxy)")
    parser.add_argument("--launcher", default="", help="an argv prefix for the agent, e.g. 'nsenter --net=PATH'")
    parser.add_argument("--tasks", type=int, default=4, help="tasks (each its own GRPO group)")
    parser.add_argument("--samples", type=int, default=2, help="episodes per task (n_samples_per_prompt)")
    parser.add_argument("--group-size", type=int, help="rows each group must have (default: --samples; 0: any)")
    parser.add_argument("--group-policy", choices=("refuse", "drop", "pad"), default="drop")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--agent-timeout", type=float, default=300.0)
    parser.add_argument("--prefix", default="episode", help="episode names: PREFIX-0000, PREFIX-0001, …")
    parser.add_argument("--format", choices=("generic", "verl", "slime", "verl-dataset"), default="generic")
    parser.add_argument("--out", type=Path, default=Path("rollouts.parquet"))
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("--token (or $TITO_CONTROL_TOKEN) is required")
    if args.agent == "openai" and not args.base_url:
        parser.error("--base-url is required with --agent openai")
    episodes, summary = asyncio.run(drive(args))
    rewards = [score(e)[0] for e in episodes]
    failed = [e for e in episodes if e.returncode != 0]
    for episode in failed:
        print(f"{episode.name}: exit {episode.returncode}: {episode.stderr.strip()[-300:]}", file=sys.stderr)
    kept = [g for g in summary["groups"] if g["group_index"] is not None]
    print(f"{len(episodes)} episodes, mean reward {sum(rewards) / len(rewards):.3f}, {summary['rows']} rows in "
          f"{len(kept)} groups in {args.out}; {summary['dropped_groups']} groups left out")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
