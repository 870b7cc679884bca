"""The token engine: chat messages in, exact prompt ids out.

Owns the tokenizer and its loading, the model families (how a turn ends and what a continuation appends), the
chat templates we ship, and the two forms of a prompt's ids a backend takes. It renders only what a turn appends
to stored ids, never the whole history. It may import the ground (`tito_addon.canonical_chat`,
`tito_addon.tito_errors`) and nothing else of the package: no session, record, backend, protocol or proxy module.
"""
