"""Loaders for trainers: exported rows in the shapes verl and slime read, run in the trainer's own environment.

Owns verl's padded batch (`verl_batch`: a `DataProto` from verl-layout rows) and slime's rollout files
(`slime_rollouts`: `{rollout_id}.pt` files of `Sample` dicts from slime-layout rows). The only modules of the package
that may import torch or a trainer, and only when called; they import nothing else of the package (the addon never
imports them; `tools.cli` does for `export --to pt`), so each runs on the trainer's Python (3.10 and later) as one
file a user may also copy.
"""
