"""The protocol-neutral turn: validate -> locate -> prepare ids -> backend -> record -> commit -> reply.

Owns `TurnService` (a whole turn, or a live stream of one, in whichever agent API it came, with no mitmproxy in
sight), the rule that the only state changes, the record line and the new tree node, happen together after the
backend answered (with a shared store: claimed before the backend runs, committed there after the line is on disk,
`shared_turns`), and the offline replay of a recorded turn (`replay_turn`). It may import every core layer
(engine, sessions, records, backends, protocols) and the ground; never the proxy, tools or replicas.
"""
