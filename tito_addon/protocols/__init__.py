"""What agents speak: each agent-facing API, translated to and from the canonical chat form.

One module per API (today `openai_chat`: its paths, request parsing and SSE framing), plus what they share
(`http_reply`, the reply every protocol produces; `json_body`, strict request JSON). A protocol module knows
nothing of sessions, ids or backends: it may import the ground only, so that a new API (Anthropic Messages,
OpenAI Responses) is one new module here and a dispatch in `turns`.
"""
