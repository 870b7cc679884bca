"""The session tree: which stored turn a request extends.

Owns the tree of turns per session (branches for retries, edits and GRPO samples), message identity (keys and
reasoning tolerance), client-supplied session ids, eviction and idle sweeps. A turn node holds ids and message
keys, never message text. The shared store (several proxies, one session space) lives here too: path digests
(`path_keys`), the tree in Redis (`redis_tree`) and each process's mirror of it (`shared_sessions`). It may import
the ground only.
"""
