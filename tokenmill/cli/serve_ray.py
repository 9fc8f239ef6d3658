"""`tokenmill serve-ray`: N engine replicas behind one OpenAI-compatible endpoint (Ray Serve)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from tokenmill.cli.serve import add_server_args, settings_from_args
from tokenmill.deploy.scale import ScaleOptions
from tokenmill.engine.config import EngineConfig
from tokenmill.options import add_options, from_args

logger = logging.getLogger(__name__)

INSTALL_HINT = "Ray Serve is not installed: pip install 'tokenmill[ray]'"
_SERVER_FLAGS = (
    "host",
    "port",
    "max_queue",
    "api_key",
    "api_key_file",
    "max_body_bytes",
    "log_format",
    "log_prompts",
    "allow_special_tokens_in_messages",
    "escape_special_tokens_in_prompts",
    "tool_call_parser",
    "embedding_pooling",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-ray",
        help="serve a model from N replicas behind one OpenAI-compatible endpoint (Ray Serve)",
        description="Scale out with Ray Serve: each replica is a Ray actor with its own engine serving the "
        "same HTTP API as `tokenmill serve` (/v1/*, /health/*, /metrics of that replica); Ray's proxy on "
        "--host:--port routes requests to replicas and Ray restarts replicas that die. Responses carry "
        "X-Tokenmill-Replica. Without --ray-address a local Ray instance is started. HTTP only (no gRPC).",
    )
    EngineConfig.add_cli_args(parser)
    # The same server settings as `tokenmill serve`, except what Ray's proxy owns: gRPC (Ray carries
    # HTTP only), draining, and the client connections (slow-client limits stay at their defaults).
    add_server_args(
        parser,
        only=_SERVER_FLAGS,
        overrides={
            "host": {"help": "address for Ray Serve's HTTP proxy (0.0.0.0 in containers)"},
            "port": {"help": "HTTP port of the proxy"},
            "max_queue": {"help": "per replica: waiting requests beyond which new ones get 429"},
            "log_format": {"default": "text", "help": "log line format of this (driver) process"},
        },
    )
    r = parser.add_argument_group("ray")
    add_options(r, ScaleOptions)
    r.add_argument(
        "--ray-address",
        default=None,
        help="existing cluster (`auto` or ray://host:10001); default: start a local Ray instance",
    )
    r.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    parser.set_defaults(func=run_serve_ray, server_omp=True)


def run_serve_ray(args: argparse.Namespace) -> int:
    from tokenmill.server.logs import configure_logging

    settings = settings_from_args(args, grpc_port=0)  # ValueError -> the CLI's one-line error
    config = EngineConfig.from_cli_args(args)
    if config.model is not None and not os.path.isdir(config.model) and args.ray_address is None:
        raise FileNotFoundError(f"model directory not found: {config.model}")
    configure_logging(settings.log_format)
    try:
        import ray
        from ray import serve

        from tokenmill.deploy import ray_serve
    except ImportError as exc:
        raise ValueError(f"{INSTALL_HINT} ({exc})") from None
    scale = from_args(ScaleOptions, args)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home unless asked to
    if args.ray_address:
        ray.init(address=args.ray_address)
    else:
        # A single-node instance only needs loopback; the proxy binds --host on its own.
        ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        ray_serve.start(config, settings, scale)
        replicas = f"{scale.min_replicas}..{scale.max_replicas}" if scale.max_replicas else str(scale.num_replicas)
        print(
            f"tokenmill serve-ray: {replicas} replica(s) of {config.model or 'the default model'} "
            f"at http://{settings.host}:{settings.port}/v1",
            flush=True,
        )
        while not stop.wait(1.0):
            pass
        logger.info("stopping: draining replicas")
    finally:
        try:
            serve.delete(ray_serve.APP_NAME)  # graceful: replicas finish in-flight requests
            if not args.ray_address:
                serve.shutdown()
        finally:
            ray.shutdown()
    return 0
