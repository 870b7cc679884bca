"""The command line: `python -m tito_addon` and its subcommands.

Owns show, export for trainers, re-drive, the drift audit and its page, verify-template and the demo, each over
the core layers. Tools may import any layer (and mitmproxy, to run mitmdump); only the demo and the
`reference-backend` subcommand may import `replicas`.
"""
