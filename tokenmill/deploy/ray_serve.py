"""Ray Serve scale-out: N replicas of the tokenmill HTTP app behind one OpenAI-compatible endpoint.

Each replica is a Ray actor that owns one `AsyncEngine` and serves tokenmill's own FastAPI app
(`tokenmill.server.app.build_app`, the same routes, errors and /metrics as `tokenmill serve`)
through `@serve.ingress`. Ray Serve's HTTP proxy is the single endpoint and routes every request
to a replica (power of two choices on ongoing requests); the controller restarts a replica whose
actor dies or whose health check (`engine.is_alive()`) fails.

Every response carries `X-Tokenmill-Replica: <replica id>` so clients and tests can see which
replica served it; `replica_actor_name()` turns that id into the replica's Ray actor name.

    ray_serve.start(EngineConfig(model=DIR), ServerSettings(host="127.0.0.1", port=8000),
                    ScaleOptions(num_replicas=2))
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, cast

from ray import serve
from ray.serve import Deployment
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.deploy.scale import ScaleOptions
from tokenmill.engine.config import EngineConfig
from tokenmill.server.settings import ServerSettings

__all__ = ["ScaleOptions", "app_builder", "build_application", "deployment_options", "replica_actor_name", "start"]

logger = logging.getLogger(__name__)

APP_NAME = "tokenmill"
DEPLOYMENT_NAME = "tokenmill"
REPLICA_HEADER = "X-Tokenmill-Replica"


def resolve_device(device: str) -> str:
    """`auto` is decided on the driver: cuda when it sees a GPU (replicas then reserve one each)."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def replica_engine_config(config: EngineConfig, scale: ScaleOptions) -> EngineConfig:
    """The engine config each replica runs: a concrete device, and on CPU one torch thread per
    reserved CPU (replicas sharing a machine must not each spawn a thread per core)."""
    device = resolve_device(config.device)
    threads = config.num_threads
    if device == "cpu" and threads is None:
        threads = max(1, int(scale.num_cpus))
    return replace(config, device=device, num_threads=threads)


def deployment_options(config: EngineConfig, scale: ScaleOptions) -> dict[str, Any]:
    """Keyword arguments for `serve.deployment(...).options(...)` (no Ray calls; unit-testable)."""
    device = resolve_device(config.device)
    if device == "cuda":
        actor: dict[str, Any] = {"num_gpus": scale.num_gpus, "num_cpus": 1}
    else:
        actor = {"num_cpus": scale.num_cpus}
    threads = replica_engine_config(config, scale).num_threads
    if device == "cpu" and threads:
        # OpenMP/MKL pools follow these, so a replica stays within the CPUs it reserved.
        actor["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}}
    opts: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": actor,
        "max_ongoing_requests": scale.max_ongoing_requests or config.max_num_seqs,
        "health_check_period_s": scale.health_check_period_s,
    }
    if scale.max_replicas is not None:
        opts["autoscaling_config"] = {
            "min_replicas": scale.min_replicas,
            "initial_replicas": min(max(scale.num_replicas, scale.min_replicas), scale.max_replicas),
            "max_replicas": scale.max_replicas,
            "target_ongoing_requests": scale.target_ongoing_requests,
        }
    else:
        opts["num_replicas"] = scale.num_replicas
    return opts


def replica_actor_name(replica_id: str, app_name: str = APP_NAME, deployment: str = DEPLOYMENT_NAME) -> str:
    """The Ray actor name (namespace "serve") of the replica whose `X-Tokenmill-Replica` is `replica_id`."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    return ReplicaID(replica_id, DeploymentID(name=deployment, app_name=app_name)).to_full_id_str()


class ReplicaHeaderMiddleware:
    """Adds `X-Tokenmill-Replica` to every HTTP response (pure ASGI: streaming stays unbuffered)."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.replica_id = replica_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_replica(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REPLICA_HEADER] = self.replica_id
            await send(message)

        await self.app(scope, receive, send_with_replica)


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class TokenmillReplica:
    """One replica: an AsyncEngine plus tokenmill's FastAPI app, built when the actor starts."""

    def __init__(self, engine_config: EngineConfig, settings: ServerSettings) -> None:
        import prometheus_client

        from tokenmill.engine.async_engine import AsyncEngine

        # Same exposition as `tokenmill serve` (no `_created` series).
        prometheus_client.disable_created_metrics()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.settings = settings
        self.engine = AsyncEngine(engine_config, progress=False)
        logger.info("replica %s: engine ready (%s)", self.replica_id, self.engine.model_name)

    def __serve_build_asgi_app__(self) -> Any:
        from tokenmill.server.app import build_app

        app = build_app(self.engine, self.settings)
        app.add_middleware(ReplicaHeaderMiddleware, replica_id=self.replica_id)
        return app

    def check_health(self) -> None:
        """Ray calls this every health_check_period_s; raising gets the replica replaced."""
        if not self.engine.is_alive():
            raise RuntimeError("the tokenmill engine loop is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def build_application(engine_config: EngineConfig, settings: ServerSettings, scale: ScaleOptions) -> Any:
    """The bound Ray Serve application (pass it to `serve.run`)."""
    settings = replace(settings, grpc_port=0)  # replicas serve HTTP only, through the Serve proxy
    # (@serve.deployment made the class a Deployment; type checkers keep a decorated class's own type.)
    deployment = cast(Deployment, TokenmillReplica).options(**deployment_options(engine_config, scale))
    return deployment.bind(replica_engine_config(engine_config, scale), settings)


def start(engine_config: EngineConfig, settings: ServerSettings, scale: ScaleOptions, app_name: str = APP_NAME) -> Any:
    """Start Serve's HTTP proxy on settings.host:port and deploy the replicas (Ray must be
    initialised); returns once every replica is up. The handle it returns is for Python callers."""
    serve.start(http_options={"host": settings.host, "port": settings.port})
    return serve.run(build_application(engine_config, settings, scale), name=app_name, route_prefix="/", blocking=False)


def app_builder(args: dict[str, Any]) -> Any:
    """Application builder for Ray Serve config files (`serve run` / `serve deploy` / KubeRay
    RayService): `import_path: tokenmill.deploy.ray_serve:app_builder` with `args` holding
    `engine` (EngineConfig fields), `server` (ServerSettings fields) and `scale` (ScaleOptions
    fields). Replica counts set in the config file's `deployments:` section override `scale`."""
    args = dict(args or {})
    unknown = set(args) - {"engine", "server", "scale"}
    if unknown:
        raise ValueError(f"unknown app_builder args: {sorted(unknown)} (expected engine, server, scale)")
    engine = EngineConfig(**(args.get("engine") or {}))
    server = ServerSettings(**{"max_num_seqs": engine.max_num_seqs, **(args.get("server") or {})})
    return build_application(engine, server, ScaleOptions(**(args.get("scale") or {})))
