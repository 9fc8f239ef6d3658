"""`tokenmill serve-ray`: N engine replicas behind one OpenAI-compatible endpoint (Ray Serve)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from tokenmill.engine.config import EngineConfig, parse_memory
from tokenmill.server.commands import API_KEY_ENV, add_special_token_args, add_tool_call_args, settings_from_args
from tokenmill.server.settings import ServerSettings

logger = logging.getLogger(__name__)

INSTALL_HINT = "Ray Serve is not installed: pip install 'tokenmill[ray]'"


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
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address for Ray Serve's HTTP proxy (0.0.0.0 in containers)")
    g.add_argument("--port", type=int, default=8000, help="HTTP port of the proxy")
    g.add_argument("--max-queue", type=int, default=256, help="per replica: waiting requests beyond which new ones get 429")
    g.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV})")
    g.add_argument("--max-body-bytes", type=parse_memory, default=1 << 20, help="largest accepted request body, e.g. 1MiB")
    g.add_argument("--log-format", choices=["json", "text"], default="text", help="log line format of this (driver) process")
    g.add_argument("--log-prompts", action="store_true", help="include prompt text in request logs")
    add_special_token_args(g)
    add_tool_call_args(g)
    r = parser.add_argument_group("ray")
    r.add_argument("--num-replicas", type=int, default=1, help="replicas (the initial count with --max-replicas)")
    r.add_argument("--max-replicas", type=int, default=None,
                   help="autoscale between --min-replicas and this on ongoing requests per replica")
    r.add_argument("--min-replicas", type=int, default=1, help="autoscaling lower bound")
    r.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="autoscaling target: in-flight requests per replica")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests Ray sends one replica at once (default: --max-num-seqs); the rest queue in Ray")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="CPUs each CPU replica reserves (also its torch threads unless --num-threads)")
    r.add_argument("--num-gpus-per-replica", type=float, default=1.0, help="GPUs each replica reserves with --device cuda")
    r.add_argument("--ray-address", default=None,
                   help="existing cluster (`auto` or ray://host:10001); default: start a local Ray instance")
    r.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray instance (default: all)")
    parser.set_defaults(func=run_serve_ray, passive_omp=True)


def _settings(args: argparse.Namespace) -> ServerSettings:
    # The same settings as `tokenmill serve`, without gRPC (Ray's proxy carries HTTP only); Ray drains,
    # and its proxy owns the client connections (so tokenmill's slow-client limits stay at their defaults).
    args.grpc_port = 0
    for name in ("drain_timeout", "header_timeout", "body_timeout", "max_connections", "keep_alive_timeout"):
        setattr(args, name, getattr(ServerSettings, name))
    return settings_from_args(args)


def run_serve_ray(args: argparse.Namespace) -> int:
    from tokenmill.server.logs import configure_logging

    settings = _settings(args)  # ValueError -> the CLI's one-line error
    config = EngineConfig.from_cli_args(args)
    if config.model is not None and not os.path.isdir(config.model) and args.ray_address is None:
        raise FileNotFoundError(f"model directory not found: {config.model}")
    configure_logging(settings.log_format)
    try:
        import ray
        from ray import serve

        from . import ray_serve
    except ImportError as exc:
        raise ValueError(f"{INSTALL_HINT} ({exc})") from None
    scale = ray_serve.ScaleOptions(
        num_replicas=args.num_replicas, max_replicas=args.max_replicas, min_replicas=args.min_replicas,
        target_ongoing_requests=args.target_ongoing_requests, max_ongoing_requests=args.max_ongoing_requests,
        num_cpus=args.num_cpus_per_replica, num_gpus=args.num_gpus_per_replica,
    )
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
        print(f"tokenmill serve-ray: {replicas} replica(s) of {config.model or 'the default model'} "
              f"at http://{settings.host}:{settings.port}/v1", flush=True)
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
