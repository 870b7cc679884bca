"""``python -m tito_addon reference-backend``: the sglang replica as a server process, steered from the command line.

The flags map onto :class:`~tito_addon.replicas.sglang_config.ReplicaConfig`; the process prints the URL it listens on
(and writes the port to ``--port-file``) and stops cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

from tito_addon.replicas.replica_runner import serve_until_stopped
from tito_addon.replicas.sglang_config import ReplicaConfig
from tito_addon.replicas.sglang_replica import ReferenceBackend

__all__ = ["main"]


async def _serve(config: ReplicaConfig, host: str, port: int, port_file: str | None) -> None:
    await serve_until_stopped(ReferenceBackend(config), host, port, port_file)


def main(argv: list[str] | None = None) -> int:
    """``python -m tito_addon reference-backend --tokenizer DIR [--port N] ...``"""
    # This process loads a tokenizer only: transformers' advice that PyTorch is missing would read as a fault.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    ap = argparse.ArgumentParser(
        prog="python -m tito_addon reference-backend",
        description="sglang-compatible reference backend (scripted model over a real HF tokenizer).",
        epilog="A CLI agent's own tools, e.g. Claude Code's shell for 3 rounds per prompt, then an answer: "
        """--call-tool 'Bash={"command": "ls"}' --tool-rounds 3 (Codex: exec_command={"cmd": "ls"}).""",
    )
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer directory or hub name")
    ap.add_argument(
        "--kind",
        choices=("sglang", "vllm"),
        default="sglang",
        help="the protocol it speaks: sglang's chat endpoint with input_ids, or vLLM 0.32's render, generate and "
        "derender (`--kind vllm --help`: a stand-in for the engines behind a router, with fewer flags)",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000, help="0 = any free port")
    ap.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds to sleep before each chat answer")
    ap.add_argument("--old-sglang", action="store_true", help="emulate sglang < 0.5.13 (ignores input_ids etc.)")
    ap.add_argument("--canonical", action="store_true", help="do not emit non-canonical token splits")
    ap.add_argument("--no-prefix-cache", action="store_true", help="always report cached_tokens 0")
    ap.add_argument(
        "--call-tool",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="on a call turn, call tool NAME with these arguments (a JSON object) when the request offers it; "
        "repeatable, the first one offered wins (default: the request's first tool, arguments made up from its "
        'schema). Two keys of the JSON steer instead of being sent: "$once": true (not again once the conversation '
        'holds a call to it) and "$agent_ids": "ARG" (fill ARG with the agent ids earlier tool results hold)',
    )
    ap.add_argument(
        "--tool-budget",
        type=int,
        default=None,
        metavar="N",
        help="after N tool-call turns (all conversations together) every turn answers: ends an agent whose "
        "contexts restart at each compaction (default: no limit)",
    )
    ap.add_argument(
        "--tool-rounds",
        type=int,
        default=None,
        metavar="N",
        help="call a tool while fewer than N assistant turns follow the last user message, whatever comes last "
        "(an agent's context messages included), then answer (default: call when the user spoke last)",
    )
    ap.add_argument(
        "--summary-answer",
        default=None,
        metavar="TEXT",
        help="the summary a compaction request gets (a last user message holding <summary> or CONTEXT CHECKPOINT "
        "COMPACTION): a text answer with this inside <summary> tags, never a tool call",
    )
    ap.add_argument(
        "--context-length",
        type=int,
        default=40960,
        metavar="N",
        help="the model's context length it reports at /v1/models; a prompt plus its max_tokens at or past it is a "
        "400, in sglang's words (default: 40960, Qwen3's)",
    )
    ap.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="as sglang's flag: a request with return_routed_experts gets the scripted model's expert routes",
    )
    args = ap.parse_args(argv)
    preferred: dict[str, dict[str, Any]] = {}
    for spec in args.call_tool:
        name, separator, arguments = spec.partition("=")
        try:
            parsed = json.loads(arguments) if separator else None
        except ValueError as exc:
            ap.error(f"--call-tool {spec!r}: the arguments are not JSON: {exc}")
        if not name or not isinstance(parsed, dict):
            ap.error(f"--call-tool {spec!r}: expected NAME=JSON, the JSON an object")
        preferred.setdefault(name, parsed)
    if args.kind != "sglang":
        ap.error("--kind vllm is served by the vLLM replica's own command line (tito_addon.replicas.vllm_cli)")
    if args.tool_rounds is not None and args.tool_rounds < 0:
        ap.error("--tool-rounds must be 0 or more")
    if args.tool_budget is not None and args.tool_budget < 0:
        ap.error("--tool-budget must be 0 or more")
    if args.context_length < 2:
        ap.error("--context-length must be 2 or more")
    config = ReplicaConfig(
        tokenizer=args.tokenizer,
        honor_input_ids=not args.old_sglang,
        latency_s=args.latency,
        noncanonical=not args.canonical,
        prefix_cache=not args.no_prefix_cache,
        preferred_tools=preferred,
        tool_rounds=args.tool_rounds,
        tool_budget=args.tool_budget,
        context_length=args.context_length,
        routed_experts=args.enable_return_routed_experts,
        **({"summary_text": args.summary_answer} if args.summary_answer is not None else {}),
    )
    try:
        asyncio.run(_serve(config, args.host, args.port, args.port_file))
    except KeyboardInterrupt:  # pragma: no cover - signal handler normally catches it
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
