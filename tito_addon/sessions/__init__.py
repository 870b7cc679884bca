"""The session tree: which stored turn a request extends.

Owns the tree of turns per session (branches for retries, edits and GRPO samples), message identity (keys and
reasoning tolerance), client-supplied session ids, eviction and idle sweeps. A turn node holds ids and message
keys, never message text. It may import the ground only; a shared store behind it (several proxies, one session
space) belongs here too.
"""
