"""tito_addon: token-exact trajectories of LLM agents, recorded by a mitmproxy addon.

Load it with `mitmdump -s tito_addon/__init__.py --mode reverse:http://HOST:PORT --set tito_tokenizer=...`
or `python -m tito_addon [mitmdump args]`. This file works both as mitmproxy's script and as the package's
`__init__`: loaded as a script, it takes its own folder off sys.path, puts the repository root there and drops
cached `tito_addon` modules, so a hot reload (touching this file) re-imports the whole package.

The package is layered; each sub-package's `__init__` says what it owns and what it may import, and
tests/fast/test_layers.py holds the walls: `canonical_chat` and `tito_errors` (the ground) <- `engine`, `sessions`
<- `records`; `backends`, `protocols` <- `turns` <- `proxy`; `tools` over all of them; `replicas` apart.
"""

if __name__.startswith("__mitmproxy_script__."):
    import os as _os
    import sys as _sys

    _package = _os.path.dirname(_os.path.abspath(__file__))
    # mitmproxy put this folder on sys.path to load the script and never takes it off (its restore is a no-op).
    # Left there, each sub-package here (engine, proxy, tools, ...) would also be a top-level name, shadowing any
    # real package of that name for every later import in the process; so it goes before anything is imported.
    _sys.path[:] = [p for p in _sys.path if not (isinstance(p, str) and _os.path.abspath(p or ".") == _package)]
    _root = _os.path.dirname(_package)
    if _root not in _sys.path:
        _sys.path.insert(0, _root)
    for _name in [n for n in _sys.modules if n == "tito_addon" or n.startswith("tito_addon.")]:
        del _sys.modules[_name]
    from tito_addon.proxy.capture_addon import TitoAddon as _TitoAddon
    from tito_addon.proxy.capture_addon import backend_of as _backend_of
    from tito_addon.proxy.control_addon import ControlAddon as _ControlAddon
    from tito_addon.proxy.episode_naming import EpisodeNaming as _EpisodeNaming
    from tito_addon.proxy.flow_file_records import FlowFileRecords as _FlowFileRecords
    from tito_addon.proxy.replay_addon import TitoReplay as _TitoReplay
    from tito_addon.proxy.session_addons import SessionListing as _SessionListing
    from tito_addon.proxy.session_addons import SessionSweeper as _SessionSweeper
    from tito_addon.proxy.token_contentview import TurnViewRegistration as _TurnViewRegistration
    from tito_addon.proxy.turn_wiring import TurnWiring as _TurnWiring

    _wiring = _TurnWiring()
    _capture = _TitoAddon(_wiring)
    # The control API answers its own host first; episode names are read (and API keys swapped) before any other
    # hook sees the request; replay then serves a recorded answer before the capture addon would go to the backend.
    addons = [
        _ControlAddon(_wiring),
        _EpisodeNaming(lambda flow: _backend_of(_wiring, flow) is not None, _wiring.facts),
        _TitoReplay(_wiring.facts),
        _capture,
        _SessionSweeper(_wiring),
        _SessionListing(_wiring),
        _FlowFileRecords(_wiring),
        _TurnViewRegistration(_wiring),  # mitmweb's and the console's "TITO turn" view of each captured turn
    ]
else:
    __version__ = "0.1.0"
