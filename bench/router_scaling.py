"""Many engines behind a router (issue 44): turns per second through one proxy with one, two and three engines behind
vllm-router, against the same proxy straight to one engine, and the latency the router hop adds to one turn.

    .venv/bin/python bench/router_scaling.py [--agents 32] [--turns 12] [--latency 0.05] [--rounds 3]

Each engine is the sglang reference backend in a process of its own (`python -m tito_addon reference-backend`),
answering every chat call after `--latency` seconds (a generation's time; it serves calls side by side, so the
proxy and the router are what can limit the rate). Agents are threads of this process with openai-python, each naming
its session and running `--turns` turns; the configurations run in interleaved rounds in one run. Prints one JSON line
per configuration: turns, the median seconds, turns per second and the ratio to the direct one-engine run; then the
median latency of one agent's sequential turns, direct and through the router, and what the hop adds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import openai  # noqa: E402
from support.basics import tokenizer_path  # noqa: E402
from support.proxy_harness import Mitmdump  # noqa: E402

from tito_addon.replicas.engine_routers import VllmRouter  # noqa: E402
from tito_addon.replicas.fleet import free_port, wait_for_port  # noqa: E402


class Engine:
    def __init__(self, latency: float) -> None:
        self.port = free_port()
        argv = [sys.executable, "-m", "tito_addon", "reference-backend", "--tokenizer", tokenizer_path("qwen3"),
                "--port", str(self.port), "--latency", str(latency)]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, 60, alive=self.proc)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def run_agents(proxy: Mitmdump, agents: int, turns: int, tag: str) -> float:
    """Seconds for `agents` concurrent agents to run `turns` turns each."""
    failures: list[BaseException] = []

    def agent(n: int) -> None:
        client = openai.OpenAI(base_url=proxy.url + f"/sessions/{tag}-{n}/v1", api_key="sk-x", max_retries=0)
        messages: list[dict] = [{"role": "user", "content": f"Agent {n} of {tag}: the weather in city {n}?"}]
        try:
            for turn in range(turns):
                message = client.chat.completions.create(model="m", messages=messages).choices[0].message
                messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}?"}]
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(agents)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.perf_counter() - began
    if failures:
        raise RuntimeError(f"{len(failures)} agents failed: {failures[0]!r}")
    return took


def turn_latencies(proxy: Mitmdump, turns: int, tag: str) -> list[float]:
    client = openai.OpenAI(base_url=proxy.url + f"/sessions/{tag}/v1", api_key="sk-x", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": f"One agent of {tag}: the weather?"}]
    took = []
    for turn in range(turns):
        began = time.perf_counter()
        message = client.chat.completions.create(model="m", messages=messages).choices[0].message
        took.append(time.perf_counter() - began)
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}?"}]
    return took


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engines = [Engine(args.latency) for _ in range(3)]
    seconds: dict[str, list[float]] = {}
    latency: dict[str, list[float]] = {"direct": [], "via_router": []}
    try:
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            work = Path(tmp)

            def proxy_to(url: str, name: str, router: bool) -> Mitmdump:
                (work / name).mkdir()
                options = {"tito_router": "vllm-router"} if router else {}
                proxy = Mitmdump(url, tokenizer=tokenizer_path("qwen3"), record_dir=work / name / "rec",
                                 cwd=work / name, options={**options, "flow_detail": "0"})  # fmt: skip
                return stack.enter_context(proxy)

            proxies = {"direct, 1 engine": proxy_to(engines[0].url, "direct", False)}
            for count in (1, 2, 3):
                router = stack.enter_context(VllmRouter([e.url for e in engines[:count]]))
                proxies[f"vllm-router, {count} engine(s)"] = proxy_to(router.url, f"router{count}", True)
            for name, proxy in proxies.items():
                run_agents(proxy, 4, 2, f"warm-{name}")
            # Interleaved rounds: each configuration meets the machine's drift alike.
            for round_ in range(args.rounds):
                for name, proxy in proxies.items():
                    took = run_agents(proxy, args.agents, args.turns, f"r{round_}-{name}")
                    seconds.setdefault(name, []).append(took)
                latency["direct"] += turn_latencies(proxies["direct, 1 engine"], 10, f"lat-d{round_}")
                latency["via_router"] += turn_latencies(proxies["vllm-router, 1 engine(s)"], 10, f"lat-r{round_}")
    finally:
        for engine in engines:
            engine.stop()
    total = args.agents * args.turns
    base = statistics.median(seconds["direct, 1 engine"])
    for name, runs in seconds.items():
        took = statistics.median(runs)
        print(json.dumps({"config": name, "turns": total, "median_s": round(took, 2),
                          "turns_per_s": round(total / took, 1), "ratio": round(base / took, 3)}))  # fmt: skip
    direct_ms = statistics.median(latency["direct"]) * 1000
    router_ms = statistics.median(latency["via_router"]) * 1000
    print(json.dumps({"one_turn_median_ms": {"direct": round(direct_ms, 1), "via_router": round(router_ms, 1),
                                             "router_hop_ms": round(router_ms - direct_ms, 1),
                                             "engine_latency_ms": args.latency * 1000}}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
