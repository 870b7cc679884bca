"""What agents speak: each agent-facing API, translated to and from the canonical chat form.

`agent_api` is what every API provides to the turn (a route, a parsed request in the canonical form, a responder
per turn that writes the reply and the stream from canonical chunks, the memos of requests it read). One module per
API: `openai_chat` (the canonical form itself), `anthropic_messages` (+ `anthropic_models`, `anthropic_translation`),
`openai_responses` (+ its models, `openai_responses_translation` and `openai_responses_reply`), `gemini_generate`
(+ `gemini_models`, `gemini_translation`, `gemini_reply`); the APIs translated
to chat fill in one template, `translated_api` (reading, validation, memo, translation, the chat body; the stream's
deltas). `routing` says which API a path belongs to and builds them all. Shared: `http_reply`, `json_body` (strict
request JSON, one validation path), `known_requests` and `known_messages` (what each API remembers of the requests
it read), `turn_refs` (the signed values agents echo back). A protocol module knows nothing of sessions, ids or
backends: it may import the ground only; a new API is one module here (two or three with its models and
translation) and one line in `routing`.
"""
