"""Stand-ins for what cannot run here, used by the demo, the tests and the benchmarks, never by the product.

Owns the sglang replica (`sglang_replica`), the vLLM scale-out replica (`vllm_replica`), both written from
`wire-formats.md` and checked against real vLLM bodies, and the harness that runs a real `mitmdump` on loopback
(`proxy_process`). Replicas import nothing of the package except each other, so they stay independent of the
code they test; only `tools.demo_run` and `tools.cli` (its `reference-backend` subcommand) import them.
"""
