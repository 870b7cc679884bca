"""Every `tito_*` setting is an option mitmproxy can take from its command line (`--set tito_x=VALUE`)."""

from __future__ import annotations

from mitmproxy import exceptions, optmanager

from tito_addon.proxy.tito_settings import TitoSettings


def as_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_every_setting_can_be_set_as_mitmproxy_parses_a_set() -> None:
    opts = optmanager.OptManager()
    TitoSettings.declare_options(opts)  # the same calls the addon makes on mitmproxy's loader
    refused = {}
    for name, field in TitoSettings.model_fields.items():
        try:
            opts.set(f"tito_{name}={as_text(field.default)}")
        except (exceptions.OptionsError, NotImplementedError) as exc:  # a float default: mitmproxy has no float type
            refused[name] = str(exc)
    assert not refused


def test_a_type_mitmproxy_cannot_parse_is_caught() -> None:
    opts = optmanager.OptManager()
    opts.add_option("tito_planted", float, 1.5, "a float, which mitmproxy's options do not parse")
    try:
        opts.set("tito_planted=2.5")
    except (exceptions.OptionsError, NotImplementedError):
        return
    raise AssertionError("mitmproxy parsed a float option: the guard above tests nothing")
