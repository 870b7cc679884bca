"""The record browser over a large record dir (issue 45): how long its list takes, cold and warm, against reading the
same dir whole as `show` and `export` read it.

    .venv/bin/python bench/record_browser.py [--turns 10000] [--rounds 3] [--long-turns 3000] [--chromium]

The dir is made of a real capture: the demo's six-turn session (`python -m tito_addon demo`: a real tokenizer, the
reference backend, a real mitmdump) copied under new session ids until it holds `--turns` turns, each session scored
and put in one of 100 groups; and one long episode, `--long-turns` turns in one chain. Measured in one process, each
figure the median of `--rounds`:
- baseline: `iter_session_files`, every session read and validated whole (what show, export and audit read);
- cold: a fresh server's first `GET /api/episodes` (its catalog built from nothing), over HTTP;
- warm: the same request again (the catalog checks each file's size and mtime, reads nothing);
- filtered and sorted: `reward_min=0.5&sort=length&order=desc`, warm;
- one turn's tokens: `GET /api/turn`, read on demand from its session's file (the first one also loads the
  tokenizer that names the tokens);
- the long episode: `GET /api/episode` (its graph and tree), its last turn's tokens, and with `--chromium` the
  seconds headless Chromium takes to draw its page.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
from aiohttp import web  # noqa: E402

from tito_addon.records.record_reader import iter_session_files  # noqa: E402
from tito_addon.tools.record_browser import RecordBrowser, browser_app  # noqa: E402


def make_dir(out: Path, turns: int) -> tuple[int, str]:
    demo = out / "demo"
    subprocess.run([sys.executable, "-m", "tito_addon", "demo", "--record-dir", str(demo)], cwd=REPO, check=True,
                   capture_output=True)  # fmt: skip
    (source,) = demo.glob("*.jsonl")
    lines = [json.loads(line) for line in source.read_bytes().splitlines() if line.strip()]
    turn_lines = [line for line in lines if line["schema"] == "tito.turn.v1"]
    records = out / "records"
    records.mkdir()
    sessions = -(-turns // len(turn_lines))
    for k in range(sessions):
        session = f"rollout-{k:06d}"
        body = []
        for line in turn_lines:
            body.append(json.dumps({**line, "session_id": session, "episode": session, "ts": line["ts"] + k}))
        reward, group = (k % 5) / 4, f"task-{k % 100}"
        note = {"schema": "tito.annotation.v1", "session_id": session, "reward": reward, "group": group,
                "ts": line["ts"] + k + 1}  # fmt: skip
        body.append(json.dumps(note))
        (records / f"{session}.jsonl").write_text("\n".join(body) + "\n")
    return sessions * len(turn_lines), f"rollout-{sessions // 2:06d}"


def draw_in_chromium(base: str, episode: str) -> float:
    """Seconds headless Chromium takes from asking for the episode's page to having drawn its graph and trees."""
    sys.path.insert(0, str(REPO / "tests"))
    from support.headless_chromium import HeadlessChromium

    with tempfile.TemporaryDirectory() as profile, HeadlessChromium(Path(profile)) as browser:
        page = browser.new_page(base + "/")
        page.wait_for("document.body.dataset.ready", timeout=60)
        started = time.perf_counter()
        page.navigate(base + f"/#/episode/{episode}")
        page.wait_for(f"document.body.dataset.ready === '#/episode/{episode}'", timeout=120, interval=0.02)
        return time.perf_counter() - started


def make_long_session(records: Path, turns: int) -> str:
    """One session of `turns` turns in one chain (an agent's long episode), from the demo's turns: each turn appends the
    demo's second turn's messages and ids and samples its completion again."""
    (source,) = (records.parent / "demo").glob("*.jsonl")
    lines = [json.loads(line) for line in source.read_bytes().splitlines() if line.strip()]
    root, step = [line for line in lines if line["schema"] == "tito.turn.v1"][:2]
    session, body, end = "long-episode", [], 0
    for k in range(turns):
        line = dict(root if k == 0 else step)
        prompt_len = end + len(line["prompt_added_ids"])
        line.update(session_id=session, episode=session, turn_id=k, parent_turn_id=k - 1 if k else None,
                    prompt_len=prompt_len, ts=root["ts"] + 10_000 + k)  # fmt: skip
        end = prompt_len + len(line["completion_ids"])
        body.append(json.dumps(line))
    (records / f"{session}.jsonl").write_text("\n".join(body) + "\n")
    return session


async def timed_get(session: aiohttp.ClientSession, url: str) -> tuple[float, dict]:
    started = time.perf_counter()
    async with session.get(url) as response:
        body = await response.json()
        assert response.status == 200, body
    return time.perf_counter() - started, body


async def measure_server(records: Path, middle: str, long: str, chromium: bool) -> dict[str, Any]:
    runner = web.AppRunner(browser_app(RecordBrowser(records)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            cold, first = await timed_get(session, base + "/api/episodes")
            warm, _ = await timed_get(session, base + "/api/episodes")
            query = "/api/episodes?reward_min=0.5&sort=length&order=desc"
            filtered, kept = await timed_get(session, base + query)
            first_turn, tokens = await timed_get(session, base + f"/api/turn?session={middle}&turn=5")
            turn, tokens = await timed_get(session, base + f"/api/turn?session={middle}&turn=4")
            listed, _ = await timed_get(session, base + "/api/sessions")
            long_episode, graph = await timed_get(session, base + f"/api/episode?id={long}")
            last = len(graph["trees"][0]["turns"]) - 1
            long_turn, _ = await timed_get(session, base + f"/api/turn?session={long}&turn={last}")
            # In a thread: the page asks this loop's server while it draws.
            drawn = await asyncio.to_thread(draw_in_chromium, base, long) if chromium else None
    finally:
        await runner.cleanup()
    times = {
        "cold": cold,
        "warm": warm,
        "filtered": filtered,
        "first_turn": first_turn,
        "turn": turn,
        "sessions": listed,
        "long_episode": long_episode,
        "long_turn": long_turn,
    }
    return {"long_drawn": drawn, **times, "episodes": first["total"], "matched": kept["matched"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-turns", type=int, default=3000, help="turns of the one long episode in the dir")
    parser.add_argument("--chromium", action="store_true", help="also time drawing the long episode in Chromium")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        turns, middle = make_dir(Path(tmp), args.turns)
        records = Path(tmp) / "records"
        long = make_long_session(records, args.long_turns)
        turns += args.long_turns
        size = sum(p.stat().st_size for p in records.iterdir())
        baselines, runs = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            read = sum(len(f.turns) for f in iter_session_files(records))
            baselines.append(time.perf_counter() - started)
            assert read == turns
            runs.append(asyncio.run(measure_server(records, middle, long, args.chromium)))
    median = {
        key: statistics.median(run[key] for run in runs)
        for key in ("cold", "warm", "filtered", "first_turn", "turn", "sessions", "long_episode", "long_turn")
    }
    baseline = statistics.median(baselines)
    print(json.dumps({
        "turns": turns, "sessions": runs[0]["episodes"], "bytes": size, "matched_filter": runs[0]["matched"],
        "baseline_read_s": round(baseline, 3),
        **{f"{key}_s": round(value, 4) for key, value in median.items()},
        "cold_vs_baseline": round(median["cold"] / baseline, 2),
        "long_drawn_s": [run["long_drawn"] and round(run["long_drawn"], 3) for run in runs],
        "machine": f"{platform.machine()} {platform.processor() or ''} python {platform.python_version()}".strip(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
