"""The `splitserve` command line: `serve`, `tiny-model` (and, later, `router` and `launch`).

Options are generated from the config dataclasses in ``config.py`` so that ``--help`` shows the
same defaults the code uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from splitserve.config import EngineConfig, ServerConfig, field_help


def _add_config_options(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    helps = field_help(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        text = helps.get(f.name, "")
        if hint is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{text} (default: {f.default})")
            continue
        base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Union else hint
        parser.add_argument(flag, dest=f.name, type=base, default=f.default, help=f"{text} (default: %(default)s)")


def _config_from(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="LLM server with disaggregated prefill and decode. `splitserve serve --model tiny` "
                    "serves the built-in tiny model with the OpenAI API.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a worker with the OpenAI-compatible HTTP API")
    _add_config_options(serve, ServerConfig)
    _add_config_options(serve, EngineConfig)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    tiny = sub.add_parser("tiny-model", help="write a small random checkpoint (for tests and demos)")
    tiny.add_argument("out_dir", help="folder to write the checkpoint into")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tiny-model":
        from splitserve.models.tiny import build_tiny_model

        path = build_tiny_model(args.out_dir, arch=args.arch, seed=args.seed)
        print(f"wrote a tiny {args.arch} checkpoint to {path}")
        return 0
    if args.command == "serve":
        import logging

        from splitserve.server.app import run_server

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return run_server(_config_from(EngineConfig, args), _config_from(ServerConfig, args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
