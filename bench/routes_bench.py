"""What MoE routes cost (issue 46): bytes on disk per token, and the time a turn takes with `tito_routed_experts` on
against the same turn with it off, through mitmdump + the addon and the vLLM or sglang replica, for a 48-layer top-8
model with 128 experts (Qwen3-235B-A22B's shape is 94x8; 48x8 is the issue's example).

    .venv/bin/python bench/routes_bench.py [--kind vllm|sglang] [--turns 12] [--added 2000]

Two replicas of the same kind, one started with --enable-return-routed-experts, each behind its own proxy (routes on
for the first, off for the second), run the same session turn by turn, alternating which goes first, so drift in
the machine's load falls on both. Each turn appends `--added` tokens of user text; the answer is ~60 tokens.
Reported per turn: the median wall time on and off and their ratio, what the record's side file grew by per
position routed, and the bytes a turn line gained. The replica's own work (computing and encoding the routes, as a
server with the flag does) is inside the "on" time: the ratio is what a user sees, not the proxy's share alone,
which is measured apart (decode, narrow and write of one turn's routes, in process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import openai  # noqa: E402
from support.basics import tokenizer_path  # noqa: E402
from support.proxy_harness import Mitmdump  # noqa: E402

from tito_addon.records.record_reader import read_session  # noqa: E402
from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread  # noqa: E402
from tito_addon.replicas.vllm_replica import VllmReplicaConfig, VllmReplicaThread  # noqa: E402

LAYERS, TOPK, EXPERTS = 48, 8, 128
WORDS = "the quick brown fox jumps over a lazy dog while agents call tools and read long results ".split()


def text_of(tokens: int, salt: int) -> str:
    return f"({salt}) " + " ".join(WORDS[i % len(WORDS)] for i in range(int(tokens / 1.3)))


def replica_of(kind: str, routes: bool):
    moe = {"routed_experts": routes, "moe_layers": LAYERS, "moe_topk": TOPK, "moe_experts": EXPERTS,
           "answer_sentences": 4, "max_model_len": 200_000} if kind == "vllm" else {
           "routed_experts": routes, "moe_layers": LAYERS, "moe_topk": TOPK, "moe_experts": EXPERTS,
           "answer_sentences": 4, "context_length": 200_000}  # fmt: skip
    if kind == "vllm":
        return VllmReplicaThread(VllmReplicaConfig(tokenizer=tokenizer_path("qwen3"), **moe))
    return ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"), **moe))


def in_process_cost(kind: str, positions: int, repeats: int = 20) -> float:
    """Milliseconds the proxy spends on one turn's routes of `positions` rows: decode the engine's base64, narrow to
    uint8, and append them to the side file."""
    from tito_addon.backends.expert_routes import RoutesAsked, RouteShape, read_sglang, read_vllm
    from tito_addon.records.trajectory_recorder import TrajectoryRecorder
    from tito_addon.replicas.expert_routing import expert_routes, sglang_routes_b64, vllm_routes_b64

    ids = [(i * 7919) % 150000 for i in range(positions + 1)]
    rows = expert_routes(ids, 0, positions, LAYERS, TOPK, EXPERTS)
    text = vllm_routes_b64(rows, EXPERTS) if kind == "vllm" else sglang_routes_b64(rows)
    read = read_vllm if kind == "vllm" else read_sglang
    asked = RoutesAsked(0, RouteShape(LAYERS, TOPK))
    recorder = TrajectoryRecorder(tempfile.mkdtemp(prefix="tito-routes-cost-"))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        found = read(text, asked, positions)
        assert found.rows is not None
        recorder.write_routes("bench", found.rows.array.tobytes())
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def run(kind: str, turns: int, added: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="tito-routes-bench-"))
    options = {"tito_upstream_timeout": "120"}
    if kind == "vllm":
        options["tito_backend_kind"] = "vllm"
    on_options = {**options, "tito_routed_experts": "true", "tito_routed_experts_shape": f"{LAYERS}x{TOPK}"}
    model = "tiny-qwen3" if kind == "vllm" else "reference-model"
    with (
        replica_of(kind, True) as on_replica,
        replica_of(kind, False) as off_replica,
        Mitmdump(on_replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=work / "on", cwd=work,
                 options=on_options) as on_proxy,
        Mitmdump(off_replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=work / "off", cwd=work,
                 options=options) as off_proxy,
    ):  # fmt: skip
        sides = {"on": on_proxy, "off": off_proxy}
        clients = {
            name: openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": "bench"},
                                max_retries=0, timeout=300)
            for name, proxy in sides.items()
        }  # fmt: skip
        histories: dict[str, list[dict]] = {name: [] for name in sides}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for turn in range(turns):
            order = ["on", "off"] if turn % 2 == 0 else ["off", "on"]
            for name in order:
                history = histories[name]
                history.append({"role": "user", "content": text_of(added, turn)})
                began = time.perf_counter()
                reply = clients[name].chat.completions.create(model=model, messages=history, max_tokens=200)
                times[name].append(time.perf_counter() - began)
                history.append({"role": "assistant", "content": reply.choices[0].message.content})
        recorded = read_session(work / "on", "bench")
        plain = read_session(work / "off", "bench")
        assert recorded is not None and plain is not None
        leaf = recorded.turns[-1]
        positions = leaf.routed_experts_through
        side = sum(p.stat().st_size for p in (work / "on").glob("*.routes"))
        line_on = sum(p.stat().st_size for p in (work / "on").glob("*.jsonl"))
        line_off = sum(p.stat().st_size for p in (work / "off").glob("*.jsonl"))
        per_turn_positions = statistics.median(t.routed_experts.rows for t in recorded.turns)
    median_on, median_off = statistics.median(times["on"][1:]), statistics.median(times["off"][1:])
    return {
        "kind": kind,
        "shape": f"{LAYERS}x{TOPK}, {EXPERTS} experts",
        "turns": turns,
        "tokens_in_session": leaf.prompt_len + len(leaf.completion_ids),
        "positions_routed": positions,
        "routes_bytes_on_disk": side,
        "bytes_per_token": round(side / positions, 1),
        "bytes_for_100k_tokens_mb": round(side / positions * 100_000 / 1e6, 1),
        "line_bytes_added_per_turn": round((line_on - line_off) / turns, 1),
        "turn_ms_on": round(median_on * 1000, 1),
        "turn_ms_off": round(median_off * 1000, 1),
        "ratio_on_off": round(median_on / median_off, 3),
        "median_positions_asked_per_turn": per_turn_positions,
        "proxy_ms_per_turn_in_process": round(in_process_cost(kind, int(per_turn_positions)), 2),
        "proxy_ms_for_100k_positions_in_process": round(in_process_cost(kind, 100_000, repeats=3), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=["vllm", "sglang", "both"], default="both")
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--added", type=int, default=2000)
    args = parser.parse_args()
    kinds = ["vllm", "sglang"] if args.kind == "both" else [args.kind]
    for kind in kinds:
        print(json.dumps(run(kind, args.turns, args.added)), flush=True)


if __name__ == "__main__":
    main()
