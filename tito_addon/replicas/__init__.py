"""Stand-ins for what cannot run here, used by the demo, the tests and the benchmarks, never by the product.

Owns the sglang replica and the vLLM scale-out replica, both written from `wire-formats.md` and checked against real
vLLM bodies, and the harness that runs real processes on loopback (`proxy_process`: a `mitmdump` with the addon;
`mitmdump_forks`: mitmdumps forked from one warmed interpreter; `fleet`: redis, haproxy, vllm-router and several
proxies). A small package of concepts:

- what both replicas share: the scripted model (`scripted_model`: what the model says, in Qwen3's format), its
  tokenizer (`replica_tokenizer`: a real HF tokenizer and the non-canonical ids), its mixture-of-experts routes
  (`expert_routing`: what `--enable-return-routed-experts` returns), the transport faults (`faults`) and how a replica
  is served (`replica_runner`: an aiohttp app, in a thread for sync tests);
- each server's wire, in modules named for it: sglang's (`sglang_replica`, the server; `sglang_config`,
  `sglang_generation`, `sglang_bodies`; `sglang_cli`, the `reference-backend` command) and vLLM's (`vllm_replica`,
  the server; `vllm_config` and one module per endpoint: `vllm_render`, `vllm_generate`, `vllm_derender`).

Replicas import nothing of the package except each other, so they stay independent of the code they test; one
server's modules never import the other's, and the shared concepts import neither (`tests/fast/test_layers.py`). Only
`tools.demo_run` and `tools.cli` (its `reference-backend` subcommand) import them.
"""
