"""The session tree: which stored turn a request extends.

Owns the tree of turns per session (branches for retries, edits and GRPO samples), message identity (keys and
reasoning tolerance), client-supplied session ids, eviction and idle sweeps. A turn node holds ids and message
keys, never message text. `session_space` is the interface the turn layer uses, whoever keeps the sessions:
`memory_sessions` (this process's `MemoryTree`) or `redis_sessions` (several proxies, one session space: path digests
in `path_keys`, the tree in Redis in `redis_tree`, each process's mirror of it). It may import
the ground only.
"""
