"""`python -m tito_addon`: subcommands, or mitmdump with the addon loaded."""

from tito_addon.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
