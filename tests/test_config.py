"""The configuration dataclasses (``splitserve/config.py``): one place per fact."""

from __future__ import annotations

from dataclasses import fields

from splitserve.cli import build_parser
from splitserve.config import FrontConfig, RouterConfig, ServerConfig, field_help


def test_the_front_end_is_declared_once_and_each_app_keeps_its_own_defaults():
    """A worker and the router share their HTTP front end's fields (one declaration, one help text
    each); an app redeclares only what differs for it: the router's ``max_connections``."""
    front = [f.name for f in fields(FrontConfig)]
    base_help = field_help(FrontConfig)
    assert set(front) == set(base_help) and all(base_help.values())
    for cls, redeclared in ((ServerConfig, set()), (RouterConfig, {"max_connections"})):
        assert set(front) <= {f.name for f in fields(cls)}
        assert set(cls.__dict__["__annotations__"]) & set(front) == redeclared
        helps = field_help(cls)
        assert {name: helps[name] for name in front} == base_help  # the base's text, redeclared or not
    assert (ServerConfig().max_connections, RouterConfig().max_connections) == (1024, 4096)
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_connections == 1024
    assert parser.parse_args(["router"]).max_connections == 4096
