"""The `splitserve` command line: `serve`, `router`, `launch`, `top`, `bench`, `tiny-model`, `make-model`.

Options are generated from the config dataclasses in ``config.py`` so that ``--help`` shows the
same defaults the code uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from splitserve.config import (DEFAULT_BOOTSTRAP_PORT, DiscoveryConfig, EngineConfig, RouterConfig, ServerConfig,
                               WorkerAddress, field_help)
from splitserve.launch import LaunchConfig


def _add_config_options(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), prefix: str = "") -> None:
    """An option per field of ``cls``; a field holding a config dataclass adds that class's options,
    each named with its ``FLAGS`` prefix (``config.DiscoveryConfig``: ``--discovery-user``)."""
    helps = field_help(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.name in skip:
            continue
        if dataclasses.is_dataclass(hint):
            _add_config_options(parser, hint, prefix=hint.FLAGS)
            continue
        name = prefix + f.name
        flag = "--" + name.replace("_", "-")
        text = helps.get(f.name, "")
        if hint is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f"{text} (default: {f.default})")
            continue
        base = typing.get_args(hint)[0] if typing.get_origin(hint) is typing.Union else hint
        parser.add_argument(flag, dest=name, type=base, default=f.default, help=f"{text} (default: %(default)s)")


def _config_from(cls, args: argparse.Namespace, prefix: str = ""):
    hints, values = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = _config_from(hints[f.name], args, hints[f.name].FLAGS)
        elif hasattr(args, prefix + f.name):
            values[f.name] = getattr(args, prefix + f.name)
    return cls(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="LLM server with disaggregated prefill and decode. `splitserve launch --model smollm2` "
                    "serves the demo model (SmolLM2-135M-Instruct) behind a router with the OpenAI API.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a worker with the OpenAI-compatible HTTP API")
    _add_config_options(serve, ServerConfig)
    _add_config_options(serve, EngineConfig)
    from splitserve.disagg.lifecycle.deadlines import Deadlines

    _add_config_options(serve.add_argument_group("lifecycle deadlines and caps (prefill and decode roles)"), Deadlines)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    router = sub.add_parser("router", help="run the router: one OpenAI endpoint in front of prefill and decode workers")
    _add_config_options(router, RouterConfig, skip=("prefill", "decode"))
    router.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                        help="a prefill worker's URL and optionally its bootstrap port "
                             f"(default {DEFAULT_BOOTSTRAP_PORT}) and id=ID, the worker id it must answer "
                             "with (else the first it answers with); repeat for each worker")
    router.add_argument("--decode", nargs="+", action="append", default=[], metavar=("URL", "id=ID"),
                        help="a decode worker's URL and optionally id=ID, the worker id it must answer with; "
                             "repeat for each worker")
    router.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    launch = sub.add_parser("launch", help="start prefill workers, decode workers and a router on this host, "
                                           "and supervise them (Ctrl-C stops all)")
    _add_config_options(launch, LaunchConfig)

    from splitserve import top

    top.add_arguments(sub.add_parser("top", help="a live terminal view of a deployment: workers, queues, KV, peers, "
                                                 "outcomes, the oldest live requests (late ones in red)",
                                     description=top.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    from splitserve.bench import cli as bench

    bench.add_arguments(sub.add_parser("bench", help="a serving benchmark against any OpenAI-compatible endpoint: "
                                                     "TTFT/ITL/TPOT/e2e percentiles, throughput, goodput, JSON, plots",
                                       description=bench.DESCRIPTION,
                                       formatter_class=argparse.RawDescriptionHelpFormatter))

    tiny = sub.add_parser("tiny-model", help="write a small random checkpoint (for tests and demos)")
    tiny.add_argument("out_dir", help="folder to write the checkpoint into")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    tiny.add_argument("--seed", type=int, default=0)
    from splitserve.models import make_model

    make_model.add_arguments(sub.add_parser("make-model", help="write a real model's shape with random weights "
                                            "as GGUF files and a Hugging Face folder (for benches)",
                                            description=make_model.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


def _without_final_collection(rc: int) -> int:
    """A server that stopped cleanly has nothing left to free but its heap: freeze it, so that the
    interpreter's shutdown does not walk every object of the model and its caches in a last garbage
    collection (seconds of CPU between a worker's "stopped" and its exit, on every stop)."""
    import gc

    gc.freeze()
    return rc


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "router", "launch"):
        _check_discovery_flags(args)
    if args.command == "tiny-model":
        from splitserve.testing.tiny import build_tiny_model

        path = build_tiny_model(args.out_dir, arch=args.arch, seed=args.seed)
        print(f"wrote a tiny {args.arch} checkpoint to {path}")
        return 0
    if args.command == "make-model":
        from splitserve.models.make_model import main as make_model_main

        return make_model_main(args)
    if args.command == "serve":
        from splitserve.server.process import run_server

        _setup_logging(args.log_level)
        from splitserve.disagg.lifecycle.deadlines import Deadlines

        deadlines = _config_from(Deadlines, args)
        try:
            deadlines.validate()
        except ValueError as exc:
            raise SystemExit(f"splitserve serve: {exc}") from None
        from splitserve.disagg.lifecycle.recompute import KV_FAILURE_POLICIES

        if args.kv_failure_policy not in KV_FAILURE_POLICIES:
            raise SystemExit(f"splitserve serve: --kv-failure-policy must be one of {', '.join(KV_FAILURE_POLICIES)}, "
                             f"got {args.kv_failure_policy!r}")
        from splitserve.auth import with_keys

        try:
            server = with_keys(_config_from(ServerConfig, args))
        except ValueError as exc:
            _bad_option("serve", exc)
        return _without_final_collection(run_server(_config_from(EngineConfig, args), server, deadlines))
    if args.command == "router":
        _setup_logging(args.log_level)
        from splitserve.router.app import run_router

        return _without_final_collection(run_router(router_config_from(args)))
    if args.command == "launch":
        from splitserve.launch import run_launch

        return run_launch(_config_from(LaunchConfig, args))
    if args.command == "top":
        from splitserve.top import main as top_main

        return top_main(args)
    if args.command == "bench":
        from splitserve.bench.cli import main as bench_main

        return bench_main(args)
    return 2


def _worker_address(flag: str, item: list[str]) -> WorkerAddress:
    """``--prefill URL [BOOTSTRAP_PORT] [id=ID]`` or ``--decode URL [id=ID]``, read."""
    from splitserve.discovery.record import check_id, check_url

    try:  # the same check as a discovered or POSTed worker's URL: nothing but http(s)://HOST:PORT
        url = check_url(item[0], f"{flag} URL")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    rest, worker_id, port = item[1:], None, None
    if rest and rest[-1].startswith("id="):
        try:
            worker_id = check_id(rest.pop()[3:], f"{flag} {url} id")
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if flag == "--decode" and rest or len(rest) > 1:
        raise SystemExit(f"{flag} takes a URL{' and at most one bootstrap port' * (flag == '--prefill')} "
                         f"and an optional id=ID, got {item}")
    if flag == "--prefill":
        try:
            port = int(rest[0]) if rest else DEFAULT_BOOTSTRAP_PORT
        except ValueError:
            raise SystemExit(f"--prefill {url}: bootstrap port {rest[0]!r} is not a number") from None
    return WorkerAddress(url, port, worker_id)


def router_config_from(args: argparse.Namespace) -> RouterConfig:
    prefill = [_worker_address("--prefill", item) for item in args.prefill]
    decode = [_worker_address("--decode", item) for item in args.decode]
    if (not prefill or not decode) and not args.discovery:
        raise SystemExit("the router needs at least one --prefill and one --decode worker, or --discovery")
    from splitserve.auth import with_keys

    try:
        config = with_keys(_config_from(RouterConfig, args))
    except ValueError as exc:
        _bad_option("router", exc)
    return dataclasses.replace(config, prefill=tuple(prefill), decode=tuple(decode))


def _check_discovery_flags(args: argparse.Namespace) -> None:
    """Exit 2 with one line for a ``--discovery`` given but empty, over-long or malformed
    (``discovery.backends.check_url``), or a ``--discovery-*`` given empty, before anything
    starts; ``launch --discovery local`` is launch's own etcd."""
    from splitserve.discovery.backends import check_access, check_url

    try:
        if args.discovery is not None and not (args.command == "launch" and args.discovery == "local"):
            check_url(args.discovery)
        if hasattr(args, DiscoveryConfig.FLAGS + "user"):  # serve and router; launch has none
            check_access(_config_from(DiscoveryConfig, args, DiscoveryConfig.FLAGS))
    except ValueError as exc:
        _bad_option(args.command, exc)


def _bad_option(command: str, exc: Exception) -> None:
    """A bad option value: say why on stderr and exit 2 (as argparse does)."""
    print(f"splitserve {command}: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
