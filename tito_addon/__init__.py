"""tito_addon: token-exact trajectories of LLM agents, recorded by a mitmproxy addon.

Load it with `mitmdump -s tito_addon/__init__.py --mode reverse:http://HOST:PORT --set tito_tokenizer=...`
or `python -m tito_addon [mitmdump args]`. This file works both as mitmproxy's script and as the package's
`__init__`: loaded as a script, it puts the repository root on sys.path and drops cached `tito_addon`
modules, so a hot reload (touching this file) re-imports the whole package.
"""

if __name__.startswith("__mitmproxy_script__."):
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if _root not in _sys.path:
        _sys.path.insert(0, _root)
    for _name in [n for n in _sys.modules if n == "tito_addon" or n.startswith("tito_addon.")]:
        del _sys.modules[_name]
    from tito_addon.proxy.capture_addon import TitoAddon as _TitoAddon
    from tito_addon.proxy.replay_addon import TitoReplay as _TitoReplay

    # Replay first: a recorded answer is served before the capture addon would go to the backend.
    addons = [_TitoReplay(), _TitoAddon()]
else:
    __version__ = "0.1.0"
