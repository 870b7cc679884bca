"""``python -m tito_addon reference-backend --kind vllm``: the vLLM replica (0.32's render, generate and derender over
the real tokenizer, with the scripted model) as a server process: a stand-in for the engines behind a router in the
README's Many engines recipes. It prints the URL it listens on (and writes the port to ``--port-file``) and stops
cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from tito_addon.replicas.replica_runner import serve_until_stopped
from tito_addon.replicas.vllm_config import VllmReplicaConfig
from tito_addon.replicas.vllm_replica import VllmReplica

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # a tokenizer only: no advice about PyTorch
    ap = argparse.ArgumentParser(
        prog="python -m tito_addon reference-backend --kind vllm",
        description="vLLM-compatible reference backend (render, generate, derender; a scripted model over a real HF "
        "tokenizer).",
    )
    ap.add_argument("--kind", choices=("vllm",), default="vllm")
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 = any free port")
    ap.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds to sleep before each generate answer")
    ap.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="as vLLM's flag: each finished generate choice carries the scripted model's expert routes",
    )
    args = ap.parse_args(argv)
    config = VllmReplicaConfig(
        tokenizer=args.tokenizer, latency_s=args.latency, routed_experts=args.enable_return_routed_experts
    )
    try:
        asyncio.run(serve_until_stopped(VllmReplica(config), args.host, args.port, args.port_file))
    except KeyboardInterrupt:  # pragma: no cover - the signal handler normally catches it
        pass
    return 0
