"""The mitmproxy shell: addons, their options, and the loopback server that relays live streams.

Owns everything that touches mitmproxy's flows and options: the capture addon (options declared in `load`,
validated in `configure` into `TitoSettings`, chat flows handed to `turns`), the replay addon, and the live
stream server. It is thin on purpose; it may import every core layer, never tools or replicas.
"""
