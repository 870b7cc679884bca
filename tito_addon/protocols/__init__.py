"""What agents speak: each agent-facing API, translated to and from the canonical chat form.

`agent_api` is what every API provides to the turn (a route, a parsed request in the canonical form, a responder
per turn that writes the reply and the stream from canonical chunks). One module per API: `openai_chat` (the
canonical form itself), `anthropic_messages` (+ `anthropic_models`), `openai_responses` (+ its models and
`openai_responses_reply`); `routing` says which API a path belongs to. Shared: `http_reply`, `json_body` (strict
request JSON, one validation path), `turn_refs` (the signed values agents echo back). A protocol module knows
nothing of sessions, ids or backends: it may import the ground only; a new API is one module here and one line in
`routing`.
"""
