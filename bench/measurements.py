"""The measurements behind `run_all.py`, each a function that returns its part of the results as JSON-ready dicts.

P1 + P4 (`p1_p4`): the P1 session through the addon, plain mitmdump and direct, plus what a backend takes to read
    the addon's bodies, the naive re-render baseline, and the recording's bytes per token (default and lean).
P1 breakdown, P5: `turn_breakdown.py` and `agent_apis.py` on a checkout, each in its own process.
P2 (`p2`): P2's load (`concurrency.py`) through N addons, N plain mitmdumps and direct, interleaved rounds, medians.
P2i (`p2_instructions`): `proxy_instructions.py` for passthrough, the addon and the "before", side by side.
P3 (`p3`): memory per stored token in the session tree.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from concurrency import measured_load, median_run, run_load
from local_servers import Backend, BackendProcess, PlainMitmdump
from p1_session import CHECKPOINTS, agent_body, conversation, post, run_session, window

from tito_addon.records.record_reader import read_session_file
from tito_addon.replicas.proxy_process import Mitmdump

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = os.environ.get("TITO_BENCH_TOKENIZER", str(REPO.parent / "shared" / "tokenizers" / "qwen3"))


def p1_p4(turns: int, repeats: int, before: Path | None = None) -> dict:
    backend = Backend()
    requests = conversation(turns)
    record_dir = Path(tempfile.mkdtemp(prefix="tito-bench-"))
    before_dir = Path(tempfile.mkdtemp(prefix="tito-bench-before-"))
    proxies = {"addon": Mitmdump(backend.url, tokenizer=TOKENIZER, record_dir=record_dir, cwd=record_dir,
                                 extra_args=["--set", "flow_detail=0"]).start()}  # fmt: skip
    if before is not None:
        proxies["before"] = Mitmdump(backend.url, tokenizer=TOKENIZER, record_dir=before_dir, cwd=before_dir,
                                     repo=before, extra_args=["--set", "flow_detail=0"]).start()  # fmt: skip
    passthrough = PlainMitmdump(backend.url)
    urls = {**{name: proxy.url for name, proxy in proxies.items()}, "plain": passthrough.url, "direct": backend.url}
    names = {"addon": "bench", "before": "bench", "plain": "plain", "direct": "direct"}
    samples: dict[str, list[list[float]]] = {name: [[] for _ in range(repeats)] for name in urls}
    # What the backend alone takes to read the prompt as ids (what the addon sends it: the ids and no conversation;
    # "full": the ids and the whole conversation, what the addon sent before), so the proxy's own share of "added"
    # can be told from the backend's cost of parsing ~1 MB of ids instead of the message text.
    from tito_addon.backends.parser_inputs import sglang_messages

    direct_ids: dict[int, list[float]] = {}
    direct_full: dict[int, list[float]] = {}
    sglang_ids: dict[int, list[float]] = {}
    sglang_full: dict[int, list[float]] = {}
    sglang_like = Backend(parse="sglang")
    sizes: dict[int, tuple[int, int, int]] = {}
    windows = {i: t for t in CHECKPOINTS if t <= turns for i in range(max(0, t - 3), min(turns, t + 2))}

    def read_as_ids(index: int, recorded: Any, ids: dict, times: int) -> None:
        turn = windows[index]
        prompt = ids[recorded.turns[index].turn_id][0]
        full = {"model": "m", "messages": requests[index], "input_ids": prompt, "logprobs": True,
                "return_meta_info": True, "stream": False}  # fmt: skip
        body = {**full, "messages": sglang_messages(requests[index], None)}
        direct_ids.setdefault(turn, []).extend(post(backend.url, body, "ids") for _ in range(times))
        direct_full.setdefault(turn, []).extend(post(backend.url, full, "ids") for _ in range(times))
        if index == turn - 1:  # the same bodies read as a Python sglang server reads them
            sglang_ids.setdefault(turn, []).extend(post(sglang_like.url, body, "ids") for _ in range(times))
            sglang_full.setdefault(turn, []).extend(post(sglang_like.url, full, "ids") for _ in range(times))
            # what the agent sends, and what the addon sends sglang for it, now and before
            sizes[turn] = (len(agent_body({"model": "m", "messages": requests[index]})), len(agent_body(body)),
                           len(agent_body(full)))  # fmt: skip

    recorded_ids: dict = {}
    try:
        # Turn by turn, each configuration in turn: a slow moment of this shared machine lands on all of them, not
        # on one configuration's whole session. The backend reading the addon's bodies joins from the second
        # round, once the first round's record holds them.
        for r in range(repeats):
            if r == 1:
                recorded = read_session_file(record_dir / "bench-0.jsonl")
                recorded_ids = recorded.full_ids()
            for index, messages in enumerate(requests):
                for name, url in urls.items():
                    samples[name][r].append(post(url, {"model": "m", "messages": messages}, f"{names[name]}-{r}"))
                if recorded_ids and index in windows:
                    read_as_ids(index, recorded, recorded_ids, 2)
    finally:
        passthrough.stop()
        for proxy in proxies.values():
            proxy.stop()
    recorded = read_session_file(record_dir / "bench-0.jsonl")
    if not recorded_ids:  # a single round
        recorded_ids = recorded.full_ids()
        for index in windows:
            read_as_ids(index, recorded, recorded_ids, 2)
    addon, plain, direct = samples["addon"], samples["plain"], samples["direct"]
    addon_before = samples.get("before", [])
    lean_dir = Path(tempfile.mkdtemp(prefix="tito-bench-lean-"))
    with Mitmdump(
        backend.url,
        tokenizer=TOKENIZER,
        record_dir=lean_dir,
        cwd=lean_dir,
        options={"tito_record_message_text": "false"},
        extra_args=["--set", "flow_detail=0"],
    ) as proxy:
        run_session(proxy.url, requests, "bench-0")  # fmt: skip
    from tito_addon.engine.tokenizer_loading import load_tokenizer

    tokenizer = load_tokenizer(TOKENIZER, trust_remote_code=False)

    def naive(turn: int) -> float:
        started = time.perf_counter()
        text = tokenizer.apply_chat_template(requests[turn - 1], tokenize=False, add_generation_prompt=True)
        tokenizer.encode(text, add_special_tokens=False)
        return time.perf_counter() - started

    result: dict = {"p1": {}}
    for turn in (t for t in CHECKPOINTS if t <= turns):
        a = statistics.median(x for run in addon for x in window(run, turn))
        p = statistics.median(x for run in plain for x in window(run, turn))
        d = statistics.median(x for run in direct for x in window(run, turn))
        n = statistics.median(naive(turn) for _ in range(5))
        di = statistics.median(direct_ids[turn])
        result["p1"][turn] = {
            "addon_ms": a * 1e3, "passthrough_ms": p * 1e3, "direct_ms": d * 1e3, "direct_with_ids_ms": di * 1e3,
            "added_vs_passthrough_ms": (a - p) * 1e3, "added_vs_direct_ms": (a - d) * 1e3,
            # Each proxy's own time: addon over the backend served ids, passthrough over it served messages.
            "proxy_own_added_ms": ((a - di) - (p - d)) * 1e3,
            "naive_rerender_ms": n * 1e3,
            "agent_request_bytes": sizes[turn][0], "backend_request_bytes": sizes[turn][1],
            "backend_request_bytes_before": sizes[turn][2],
            "sglang_parse_ms": statistics.median(sglang_ids[turn]) * 1e3,
            "sglang_parse_before_ms": statistics.median(sglang_full[turn]) * 1e3,
        }  # fmt: skip
        if addon_before:
            b = statistics.median(x for run in addon_before for x in window(run, turn))
            result["p1"][turn]["addon_before_ms"] = b * 1e3
            df = statistics.median(direct_full[turn])
            result["p1"][turn]["direct_with_ids_full_ms"] = df * 1e3
            result["p1"][turn]["proxy_own_added_before_ms"] = ((b - df) - (p - d)) * 1e3
    first, last = result["p1"][min(result["p1"])], result["p1"][max(result["p1"])]
    result["p1"]["last_over_first_added"] = last["added_vs_passthrough_ms"] / max(
        first["added_vs_passthrough_ms"], 1e-9
    )
    result["p1"]["last_over_first_proxy_own"] = last["proxy_own_added_ms"] / max(first["proxy_own_added_ms"], 1e-9)

    result["p4"] = p4(record_dir / "bench-0.jsonl")
    result["p4_without_message_text"] = p4(lean_dir / "bench-0.jsonl")
    return result


def p4(path: Path) -> dict:
    """The session file's bytes against the trajectory's own size: its final ids + logprobs as compact JSON."""
    session_file = read_session_file(path)
    ids = session_file.full_ids()
    leaf = session_file.turns[-1]
    prompt, completion = ids[leaf.turn_id]
    logprobs = [lp for t in session_file.turns for lp in t.completion_logprobs]
    own = len(json.dumps({"ids": prompt + completion, "logprobs": logprobs}, separators=(",", ":")))
    file_bytes = path.stat().st_size
    return {
        "tokens": len(prompt) + len(completion),
        "file_bytes": file_bytes,
        "trajectory_bytes": own,
        "bytes_per_token": file_bytes / (len(prompt) + len(completion)),
        "ratio": file_bytes / own,
    }


def p1_breakdown(turns: int, repo: Path = REPO) -> dict:
    """bench/turn_breakdown.py on `repo` (this checkout, or the "before" one), in its own process."""
    argv = [sys.executable, str(REPO / "bench" / "turn_breakdown.py"), "--repo", str(repo), "--turns", str(turns),
            "--tokenizer", TOKENIZER]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def p5_run(repo: Path = REPO) -> dict:
    """bench/agent_apis.py on `repo` (this checkout, or the "before" one), in its own process."""
    argv = [sys.executable, str(REPO / "bench" / "agent_apis.py"), "--repo", str(repo)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def p2(
    sessions: int = 256,
    turns: int = 10,
    latency_s: float = 0.1,
    processes: tuple[int, ...] = (1, 2),
    before: Path | None = None,
    rounds: int = 3,
) -> dict:
    """Each configuration runs `rounds` times, interleaved (passthrough, addon, addon before; then again), and is
    reported by its median run: a single run on this shared machine moves by ±20 %, and interleaving keeps a slow
    minute from landing on one configuration only."""
    backend = BackendProcess(latency_s)
    result: dict = {"sessions": sessions, "turns_per_session": turns, "backend_latency_ms": latency_s * 1e3,
                    "rounds": rounds}  # fmt: skip

    def addon_run(n: int, repo: Path | None) -> dict:
        record_dir = Path(tempfile.mkdtemp(prefix="tito-bench-p2-"))
        addons = [
            Mitmdump(backend.url, tokenizer=TOKENIZER, record_dir=record_dir, cwd=record_dir, repo=repo,
                     extra_args=["--set", "flow_detail=0"]).start()
            for _ in range(n)
        ]  # fmt: skip
        try:
            run = measured_load([a.url for a in addons], [a.proc.pid for a in addons if a.proc], sessions, turns)
        finally:
            for proxy in addons:
                proxy.stop()
        run["recorded_turns"] = sum(len(read_session_file(f).turns) for f in record_dir.glob("*.jsonl"))
        run["sessions_on_disk"] = len(list(record_dir.glob("*.jsonl")))
        return run

    def plain_run(n: int) -> dict:
        plain = [PlainMitmdump(backend.url) for _ in range(n)]
        try:
            return measured_load([p.url for p in plain], [p.proc.pid for p in plain], sessions, turns)
        finally:
            for proxy in plain:
                proxy.stop()

    try:
        result["direct"] = run_load([backend.url], sessions, turns)
        for n in processes:
            runs: dict[str, list[dict]] = {"passthrough": [], "addon": [], "addon_before": []}
            for _ in range(rounds):
                runs["passthrough"].append(plain_run(n))
                runs["addon"].append(addon_run(n, None))
                if before is not None:
                    runs["addon_before"].append(addon_run(n, before))
            for name, done in runs.items():
                if done:
                    result[f"{name}_x{n}"] = median_run(done)
            plain_run_, addon = result[f"passthrough_x{n}"], result[f"addon_x{n}"]
            ratio = result[f"ratio_x{n}"] = {
                "throughput_addon_over_passthrough": addon["turns_per_s"] / plain_run_["turns_per_s"],
                "p99_added_ms": addon["p99_ms"] - plain_run_["p99_ms"],
                "p50_added_ms": addon["p50_ms"] - plain_run_["p50_ms"],
            }
            if "proxy_cpu_ms_per_turn" in addon and "proxy_cpu_ms_per_turn" in plain_run_:
                ratio["cpu_passthrough_over_addon"] = (
                    plain_run_["proxy_cpu_ms_per_turn"] / addon["proxy_cpu_ms_per_turn"]
                )
            if before is not None:
                old = result[f"addon_before_x{n}"]
                ratio["throughput_before_over_passthrough"] = old["turns_per_s"] / plain_run_["turns_per_s"]
                if "proxy_cpu_ms_per_turn" in old and "proxy_cpu_ms_per_turn" in plain_run_:
                    ratio["cpu_passthrough_over_before"] = (
                        plain_run_["proxy_cpu_ms_per_turn"] / old["proxy_cpu_ms_per_turn"]
                    )
    finally:
        backend.close()
    return result


def p2_instructions(before: Path | None = None) -> dict:
    """P2's turns in instructions a turn, whole proxy process under callgrind (`bench/proxy_instructions.py`):
    passthrough, the addon and the addon "before", side by side (the counts do not depend on the machine's load)."""
    script = str(REPO / "bench" / "proxy_instructions.py")
    jobs = {"passthrough": [script, "passthrough"], "addon": [script, "addon"]}
    if before is not None:
        jobs["addon_before"] = [script, "addon", "--repo", str(before)]
    procs = {name: subprocess.Popen([sys.executable, *argv, "--json"], stdout=subprocess.PIPE, text=True)
             for name, argv in jobs.items()}  # fmt: skip
    result: dict = {}
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=7200)
            if proc.returncode != 0:
                raise RuntimeError(f"proxy_instructions {name} exited {proc.returncode}")
            result[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():  # one failed: the others would run on under callgrind for minutes
            if proc.poll() is None:
                proc.kill()
    plain = result["passthrough"]["instructions_per_turn"]
    result["passthrough_over_addon"] = plain / result["addon"]["instructions_per_turn"]
    if before is not None:
        result["passthrough_over_before"] = plain / result["addon_before"]["instructions_per_turn"]
    return result


def p3(sessions: int = 1000, tokens_per_session: int = 20_000, turns: int = 20) -> dict:
    from tito_addon.canonical_chat import ChatMessage
    from tito_addon.sessions.message_keys import message_key
    from tito_addon.sessions.session_tree import MemoryTree
    from tito_addon.sessions.turn_entity import Turn

    per_turn = tokens_per_session // turns
    user = ChatMessage(role="user", content="q")
    reply = ChatMessage(role="assistant", content="a")
    keys = (message_key(user), message_key(reply))
    ids = list(range(100, 100 + per_turn // 2))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = MemoryTree()
    for s in range(sessions):
        session = store.new_session(f"s{s}")
        parent = None
        for t in range(turns):
            parent = store.commit(session, parent, Turn(2 * (t + 1), keys, None, ids, ids, "stop"))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    total = sessions * turns * 2 * len(ids)
    return {"sessions": sessions, "tokens": total, "bytes": used, "bytes_per_token": used / total}


def added_at(measured: dict[str, list[float]], turn: int) -> dict[str, float]:
    """The medians around `turn`: the addon's, plain mitmdump's on each baseline, and the addon's time over each."""
    addon = window(measured["addon"], turn)
    out = {"addon_ms": statistics.median(addon) * 1e3}
    for baseline, name in (("plain", "added_ms"), ("messages", "added_vs_messages_ms")):
        if measured.get(baseline):
            other = window(measured[baseline], turn)
            out[f"{baseline}_ms"] = statistics.median(other) * 1e3
            out[name] = statistics.median(a - b for a, b in zip(addon, other, strict=True)) * 1e3
    return out
