"""MiniBatch on Ray Serve: N replicas of the whole server behind one HTTP endpoint, same API.

Each replica is one full MiniBatch server (``server.create_app``: scheduler + engine + ops) hosted
with ``@serve.ingress``. By default Serve's proxy hands each request to the gateway (deploy/gateway.py),
which calls a replica through a DeploymentHandle (``handle_http``), so a replica that dies under a request is
answered in the API's error shape (or the request is resent, when nothing reached the client yet), and the
router may route on the prompt's prefix (deploy/routing.py). With ``gateway: false`` the proxy calls the
replicas directly (one hop less; a dead replica's requests get the proxy's plain 500).
Nothing in the server stack knows about Ray: this module only builds the app, reads
the same environment variables (``Config.from_env``), and adds what a fleet needs:

* ``NUM_THREADS`` defaults to the CPUs Ray gave the replica, so replicas sharing a node do not
  oversubscribe its cores;
* routing knobs derived from the config: ``max_ongoing_requests`` from ``MAX_BATCH_SIZE``, the
  autoscaling target, the proxy's queue bound, the shutdown grace from ``DRAIN_TIMEOUT_S``;
* ``check_health`` answers from ``GET /health`` (model loaded, engine loop alive);
* an ``x-minibatch-replica`` response header naming the replica that answered;
* the replica's ``/metrics`` mirrored into Ray's metrics system with a ``replica`` label.

Run: ``serve run deploy/serve_config.yaml`` (see docs/deploy.md), or from
Python: ``serve.run(build_app({"num_replicas": 2, "env": {"MODEL_ID": "fake"}}))``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import fields, replace
from typing import Any

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.metrics import Gauge

from api.ops import replay_body
from config import Config
from deploy.gateway import GatewayApp, GatewaySettings
from deploy.routing import PrefixAffinityRouter
from server import create_app

# The project's root: the replicas import the project from it (``runtime_env``'s PYTHONPATH, set by ``build_app``).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

log = logging.getLogger("minibatch.ray_serve")

DEPLOYMENT_NAME = "MiniBatch"
GATEWAY_NAME = "Gateway"
ROUTINGS = ("pow2", "prefix_affinity")
REPLICA_HEADER = "x-minibatch-replica"
# Seconds between two copies of the replica's /metrics into Ray's metrics system. Ray's own export
# interval comes on top; the copy itself is a local ASGI call and a text parse (about a millisecond).
METRICS_PERIOD_S = 1.0
# Environment the replicas need besides the Config fields: the GGUF conversion cache.
EXTRA_ENV = ("MINIBATCH_CACHE",)


# --- configuration: environment -> replica env and deployment options --------------------------------
def config_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``environ`` the server reads (Config fields upper-cased, plus EXTRA_ENV)."""
    names = {f.name.upper() for f in fields(Config)} | set(EXTRA_ENV)
    return {k: v for k, v in environ.items() if k in names}


def deployment_options(cfg: Config, args: Mapping[str, Any]) -> dict[str, Any]:
    """Serve deployment options derived from the server's config and the builder's ``args``.

    * ``max_ongoing_requests`` = 2 x MAX_BATCH_SIZE: one batch running plus one batch waiting at the
      replica, so a freed slot is refilled at the next step without a round trip to the router, while
      everything beyond that waits in the router's queue (in the gateway, or the proxy without it), where
      the router can give it to whichever replica frees up first. A replica with a deep queue of its own
      would swallow requests another replica could start at once. Capped by MAX_CONCURRENT_REQUESTS
      (else 429s).
    * ``max_queued_requests`` = MAX_QUEUE_DEPTH: the router's queue (per gateway replica, or per proxy)
      has the bound one server's queue has; beyond it, 503.
    * ``routing: prefix_affinity``: the PrefixAffinityRouter (deploy/routing.py), which keeps a prompt
      prefix on one replica while that replica has fewer than ``max_affinity_load`` (default
      MAX_BATCH_SIZE) requests in flight.
    * autoscaling (when ``min_replicas``/``max_replicas`` are given): target MAX_BATCH_SIZE ongoing
      requests per replica (a full batch), scale up after 10 s of sustained excess, down only after
      300 s (a new replica pays the model load).
    * shutdown: Serve waits for in-flight requests (checked every 0.5 s) up to DRAIN_TIMEOUT_S + 5 s,
      then runs the app's shutdown, which aborts leftovers with "server is shutting down".
    """
    batch = cfg.max_batch_size
    ongoing = 2 * batch
    if cfg.max_concurrent_requests:
        ongoing = min(ongoing, cfg.max_concurrent_requests)
    options: dict[str, Any] = {
        "max_ongoing_requests": ongoing,
        "max_queued_requests": cfg.max_queue_depth,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": cfg.drain_timeout_s + 5.0,
        "health_check_period_s": float(args.get("health_check_period_s", 5.0)),
        "health_check_timeout_s": 30.0,
    }
    if "min_replicas" in args or "max_replicas" in args:
        options["autoscaling_config"] = {
            "min_replicas": int(args.get("min_replicas", 1)),
            "max_replicas": int(args.get("max_replicas", 1)),
            "target_ongoing_requests": min(batch, ongoing),
            "upscale_delay_s": 10.0,
            "downscale_delay_s": 300.0,
            **dict(args.get("autoscaling_config", {})),
        }
    else:
        options["num_replicas"] = int(args.get("num_replicas", 1))
    if "max_constructor_retry_count" in args:
        options["max_constructor_retry_count"] = int(args["max_constructor_retry_count"])
    if routing(args) == "prefix_affinity":
        options["request_router_config"] = {
            "request_router_class": PrefixAffinityRouter,
            "request_router_kwargs": {"max_affinity_load": int(args.get("max_affinity_load", batch))},
        }
    return options


def routing(args: Mapping[str, Any]) -> str:
    """The ``routing`` arg, checked: ``pow2`` (Serve's power of two choices) or ``prefix_affinity`` (gateway only)."""
    name = str(args.get("routing", "pow2"))
    if name not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, not {name!r}")
    if name == "prefix_affinity" and not args.get("gateway", True):
        raise ValueError("routing: prefix_affinity needs the gateway (gateway: true): the proxy cannot see the prompt")
    return name


def gateway_options(cfg: Config, args: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """Serve options of the gateway deployment, from the model deployment's (``model``).

    The gateway only relays, so it takes every request the replicas and the router's queue can hold
    (``max_ongoing_requests``: the largest fleet's in-flight bound plus MAX_QUEUE_DEPTH); the replicas'
    own bounds then apply as without it. It drains after the replicas do (their grace + 5 s)."""
    most = int(model.get("autoscaling_config", {}).get("max_replicas", model.get("num_replicas", 1)))
    return {
        "num_replicas": int(args.get("gateway_replicas", 1)),
        "max_ongoing_requests": most * model["max_ongoing_requests"] + cfg.max_queue_depth,
        "graceful_shutdown_wait_loop_s": 0.5,
        "graceful_shutdown_timeout_s": model["graceful_shutdown_timeout_s"] + 5.0,
    }


def gateway_settings(cfg: Config, args: Mapping[str, Any]) -> dict[str, Any]:
    """The gateway's GatewaySettings (as a dict, the deployment's init argument)."""
    affinity = routing(args) == "prefix_affinity"
    return {
        "max_body_bytes": cfg.max_body_bytes,
        "body_timeout_s": cfg.body_timeout_s,
        "replica_retries": int(args.get("replica_retries", 2)),
        "affinity_prefix_chars": int(args.get("affinity_prefix_chars", 128)) if affinity else 0,
    }


def replica_config(environ: Mapping[str, str], assigned_cpus: float) -> Config:
    """The replica's Config: the environment, with NUM_THREADS=0 meaning the CPUs Ray assigned it."""
    cfg = Config.from_env(environ)
    if cfg.num_threads == 0 and assigned_cpus >= 1:
        cfg = replace(cfg, num_threads=int(assigned_cpus))
    return cfg


# --- the replica ------------------------------------------------------------------------------------
def keep_replica_grpc_on_loopback() -> bool:
    """On a node whose address is loopback, bind this replica's inter-deployment gRPC server to 127.0.0.1.

    Ray Serve 2.60 binds it to ``[::]:0`` (every interface) unconditionally, right after the replica's
    constructor, even in single-machine mode where nothing else can reach the node. Only Serve's
    in-cluster calls use that server, and they address it at the node's IP: loopback here, so nothing
    changes for them. On a real multi-node cluster (node IP not loopback) this does nothing. Returns
    whether it patched.
    """
    if not ray.util.get_node_ip_address().startswith("127."):
        return False
    from ray.serve._private import replica as replica_module

    original = getattr(replica_module, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "loopback_only", False):
        return original is not None

    def add_port(server, address: str) -> int:
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address[len("[::]:") :]
        return original(server, address)

    add_port.loopback_only = True  # type: ignore[attr-defined]
    replica_module.add_port_to_grpc_server = add_port
    return True


async def probe_health(local: httpx.AsyncClient, replica: str) -> None:
    """Raise unless the app's ``GET /health`` is 200: it is 503 before the model has loaded and after the
    engine loop has died (a draining replica is still healthy: it finishes its requests)."""
    r = await local.get("/health")
    if r.status_code != 200:
        raise RuntimeError(f"replica {replica} unhealthy: /health answered {r.status_code} {r.text}")


class ReplicaHeader:
    """Pure ASGI middleware: every HTTP response carries ``x-minibatch-replica: <replica id>``
    (streams too; a buffering middleware would hide client disconnects from the app)."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_header)


class MetricsMirror:
    """Copies the replica's own ``/metrics`` samples into Ray Serve gauges.

    Each sample ``minibatch:<name>{labels}`` becomes the gauge ``minibatch_<name>`` with the same labels
    plus Serve's ``deployment``, ``replica`` and ``application`` (Ray's exporter prefixes ``ray_``). Counters
    and histogram buckets are copied as their cumulative values, so ``rate()`` and ``histogram_quantile()``
    work on them as on the originals; a replaced replica starts from zero under a new replica label.
    """

    def __init__(self) -> None:
        self._gauges: dict[tuple[str, tuple[str, ...]], Gauge] = {}

    def update(self, text: str) -> int:
        """Record every sample of a Prometheus text page; return how many."""
        n = 0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.replace(":", "_")
                keys = tuple(sorted(sample.labels))
                gauge = self._gauges.get((name, keys))
                if gauge is None:
                    gauge = self._gauges[(name, keys)] = Gauge(name, family.documentation, tag_keys=keys)
                gauge.set(float(sample.value), tags=dict(sample.labels))
                n += 1
        return n


async def run_asgi(app, scope: dict, body: bytes) -> AsyncIterator[list[dict]]:
    """Run one HTTP request through ``app`` in this process and yield its ASGI messages, in lists of whatever is
    ready at once (a stream under load crosses to the gateway in fewer calls).

    ``receive`` gives the body whole, then waits until the caller goes away: closing or cancelling this
    generator (the gateway's client left) shows the app ``http.disconnect`` and cancels it, which aborts its
    sequences, as a client disconnect does on one server."""
    out: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()

    async def disconnect() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    receive = replay_body(body, disconnect)

    async def send(message: dict) -> None:
        out.put_nowait(message)

    task = asyncio.ensure_future(app(dict(scope), receive, send))
    task.add_done_callback(lambda _: out.put_nowait(None))  # after the app's last message
    try:
        while True:
            batch = [await out.get()]
            await asyncio.sleep(0)  # what the app sends in the same turn of the loop goes in the same batch
            while not out.empty():
                batch.append(out.get_nowait())
            messages = [m for m in batch if m is not None]
            if messages:
                yield messages
            if batch[-1] is None:
                break
        task.result()  # the app's own exception, if it raised one instead of answering
    finally:
        if not task.done():
            gone.set()
            task.cancel()


class ReplicaCore:
    """One full MiniBatch server (scheduler + engine) per replica, configured from the environment
    (``runtime_env.env_vars``, set by ``build_app``). Two deployments share it: MiniBatchReplica behind the
    gateway (called through ``handle_http``) and MiniBatchServer, the app's ingress without it (Serve allows one
    ingress per app, so the replica is not one behind the gateway)."""

    async def __init__(self) -> None:
        keep_replica_grpc_on_loopback()
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
        self.config = replica_config(os.environ, cpus)  # a bad value fails the replica here, naming the variable
        self.server_app = create_app(self.config)  # (``app`` is Serve's property)
        self.server_app.add_middleware(ReplicaHeader, replica=self.replica)
        # In-process calls to the app's own probes (no socket): the health check and the metrics copy.
        self.local = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.server_app), base_url="http://replica")
        self.mirror = MetricsMirror()
        self._mirror_task = asyncio.get_running_loop().create_task(self._mirror_metrics(), name="metrics-mirror")
        log.info("replica %s: model %s, num_threads %d", self.replica, self.config.model_id, self.config.num_threads)

    async def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising makes Serve replace the replica.

        ``GET /health`` is 503 before the model has loaded and after the engine loop has died.
        """
        await probe_health(self.local, self.replica)

    async def _mirror_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_PERIOD_S)
            try:
                r = await self.local.get("/metrics")
                self.mirror.update(r.text)
            except Exception:  # a failed copy must not end the loop; the next one retries
                log.exception("copying /metrics into Ray's metrics failed")

    async def __del__(self) -> None:
        """After Serve's drain and the app's shutdown (which aborted anything left)."""
        task, local = getattr(self, "_mirror_task", None), getattr(self, "local", None)  # None: __init__ failed
        if task is not None:
            task.cancel()
        if local is not None:
            await local.aclose()


@serve.deployment(name=DEPLOYMENT_NAME)
class MiniBatchReplica(ReplicaCore):
    """A replica behind the gateway: it runs the app's lifespan itself (model load, scheduler start)."""

    async def __init__(self) -> None:
        await super().__init__()
        self._lifespan = self.server_app.router.lifespan_context(self.server_app)
        await self._lifespan.__aenter__()  # a model that fails to load fails the replica here, with its error

    async def handle_http(self, request: dict, prefix_key: str | None = None) -> AsyncIterator[list[dict]]:
        """One HTTP request from the gateway (its scope fields and whole body) through this replica's app;
        yields the answer's ASGI messages. ``prefix_key`` is for the router (deploy/routing.py), not used here."""
        async for batch in run_asgi(self.server_app, request["scope"], request["body"]):
            yield batch

    async def __del__(self) -> None:
        """After Serve's drain: the app's shutdown (aborting anything left), then the core's."""
        lifespan = getattr(self, "_lifespan", None)
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)
        await super().__del__()


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress()
class MiniBatchServer(ReplicaCore):
    """A replica as the app's ingress (``gateway: false``): Serve's proxy calls its app directly."""

    def __serve_build_asgi_app__(self):
        """Serve runs the app's lifespan (model load, scheduler start) after this returns."""
        return self.server_app


@serve.deployment(name=GATEWAY_NAME, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Gateway:
    """The app's HTTP ingress: relays each request to a MiniBatchReplica (deploy/gateway.py)."""

    def __init__(self, model, settings: dict) -> None:
        keep_replica_grpc_on_loopback()
        self.gateway = GatewayApp(model, GatewaySettings(**settings))

    def __serve_build_asgi_app__(self):
        return self.gateway


def build_app(args: Mapping[str, Any] | None = None):
    """The Serve application (``import_path: deploy.ray_serve:build_app`` in a Serve config).

    ``args`` (the config's ``args:``): ``num_replicas`` (default 1), or ``min_replicas``/``max_replicas``
    (and optionally ``autoscaling_config`` overrides) for autoscaling; ``num_cpus`` per replica (default 1;
    also NUM_THREADS's default); ``env``: variables on top of the environment this builder sees;
    ``gateway`` (default true), ``gateway_replicas`` (1), ``replica_retries`` (2); ``routing`` (``pow2`` or
    ``prefix_affinity``), ``affinity_prefix_chars`` (128), ``max_affinity_load`` (MAX_BATCH_SIZE).
    The server's variables (MODEL_ID, MAX_BATCH_SIZE, ...) found in that environment travel to every
    replica through ``runtime_env.env_vars``; the config is validated here first, so a bad value fails the
    deploy with the variable's name instead of failing replicas one by one.
    """
    args = dict(args or {})
    env = {**config_env(os.environ), **{str(k): str(v) for k, v in dict(args.get("env", {})).items()}}
    cfg = Config.from_env(env)
    options = deployment_options(cfg, args)
    # The replicas import the project from ROOT (with a Serve config's working_dir, from their own copy).
    replica_env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)}
    runtime_env = {"env_vars": replica_env}
    options["ray_actor_options"] = {"num_cpus": float(args.get("num_cpus", 1)), "runtime_env": runtime_env}
    if not args.get("gateway", True):
        return MiniBatchServer.options(**options).bind()
    model = MiniBatchReplica.options(**options).bind()
    gateway = gateway_options(cfg, args, options)
    gateway["ray_actor_options"] = {"num_cpus": 0, "runtime_env": runtime_env}
    return Gateway.options(**gateway).bind(model, gateway_settings(cfg, args))
