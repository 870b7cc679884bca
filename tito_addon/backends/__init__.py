"""Backends: exact prompt ids in, exact completion ids and logprobs out, over each server's own wire.

Owns the backend interface (`backend_protocol`), the sglang and vLLM kinds, the upstream HTTP client, the
routing of agent hosts to backend URLs, and the accumulation of a backend's streamed chunks. Backends speak the
canonical chat form upstream (sglang and vLLM take OpenAI chat bodies plus ids). They may import the ground and
`engine` (for prompt ids); never sessions, records, protocols, turns or the proxy.
"""
