"""The protocol-neutral turn: validate -> locate -> prepare ids -> backend -> record -> commit -> reply.

Owns `TurnService` (a whole turn, or a live stream of one, with no mitmproxy in sight) and the rule that the
only state changes, the record line and the new tree node, happen together after the backend answered. It may
import every core layer (engine, sessions, records, backends, protocols) and the ground; never the proxy, tools
or replicas.
"""
