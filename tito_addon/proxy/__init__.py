"""The mitmproxy shell: addons, their options, and the loopback server that relays live streams.

Owns everything that touches mitmproxy's flows and options: the capture addon (options declared from the settings
model `TitoSettings`, validated in `configure`, chat flows handed to `turns`), the mitmproxy-free wiring from settings
to the turn service (`turn_wiring`), the session sweeper and listing, the records regenerated from flow files, the
replay and control addons, episode naming, the live stream server, and the "TITO turn" content view that shows a
captured turn's tokens in mitmweb and the console. Addons read what they share from the wiring, never from each
other. It is thin on purpose; it may import every core layer, never tools or replicas.
"""
