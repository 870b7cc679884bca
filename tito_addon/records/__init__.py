"""Recordings: the trajectory format on disk, its writer and its readers.

Owns the record models (one JSON line per turn, a close line per session), the append-only writer that maps a
session id (and a writer process's id) to a safe file name inside the record dir, the reader that rebuilds
prompts and session trees from those lines, merging a session's per-writer parts (resume after a restart,
replay, export, audit), episodes' segments as trainer rows (grouped, sized and numbered for a trainer), and the replay
index over a record dir. It may import the ground and `sessions`; never a
backend, protocol, turn or proxy module.
"""
