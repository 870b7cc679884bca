"""The protocol-neutral turn: validate -> locate -> prepare ids -> claim -> backend -> record -> commit -> reply.

Owns `TurnService` (a whole turn, or a live stream of one, in whichever agent API it came, with no mitmproxy in
sight; its shapes in `turn_types`, a claimed turn in flight in `turn_run`), the rule that the only lasting changes,
the record line and the new tree node, happen together after the backend answered (`session_records`: a claim
marks the turn in flight before the backend runs, the line is on disk before the sessions know the turn), what a
rollout driver asks of sessions (`session_control`), and the offline replay of a recorded turn (`replay_turn`). It
may import every core layer (engine, records, backends, protocols) and the ground, and of `sessions` only the
interface (`session_space` and the shapes it speaks in); never the proxy, tools or replicas, and no module the
orchestrator (`turn_service`) calls imports it back.
"""
