"""``kvserve serve --data-parallel-size N --distributed-executor-backend ray``: N engine replicas as Ray actors
(``ray_replica.py``: each a whole server with its own KV cache and ``--num-threads`` torch threads), and in
this process the router (``router.py``) over their URLs on ``--host``/``--port``.

    kvserve serve smollm2-135m-instruct --data-parallel-size 2 --num-threads 1 --port 8000 [--ray-address HOST:PORT]

Placement: one placement group of N bundles ``{"CPU": threads}``, strategy ``SPREAD`` (one replica per node
when the nodes allow it; ``--data-parallel-placement pack`` keeps them together). Without ``--ray-address`` a
local single-node cluster is started on 127.0.0.1 (no dashboard, no usage stats, a 100 MiB object store) and
shut down at exit; with it, this process joins that cluster as a driver and leaves it as it was.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

BACKENDS = ("mp", "ray")
PLACEMENTS = {"spread": "SPREAD", "pack": "PACK", "strict-spread": "STRICT_SPREAD"}
_OBJECT_STORE_BYTES = 100 * 2**20  # only small control messages go through it (Ray's minimum is 75 MiB)
_PLACEMENT_TIMEOUT_S = 60.0
_LOCAL_START_TRIES = 3
_REPLICA_START_TIMEOUT_S = 600.0


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    """``kvserve serve``'s data-parallel flags (spelled as vLLM's)."""
    g = parser.add_argument_group("data parallel")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, each with its own KV cache and --num-threads threads (default 1)")
    # (--distributed-executor-backend is an engine flag: EngineConfig.add_cli_args)
    g.add_argument("--ray-address", default=None,
                   help="a Ray cluster to join (HOST:PORT of its head); default: start a local one on 127.0.0.1")
    g.add_argument("--data-parallel-placement", choices=list(PLACEMENTS), default="spread",
                   help="Ray placement of the replicas: spread (default; one per node when possible), "
                        "strict-spread (one per node or fail), pack")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one replica request may take, a whole stream included (default 600)")


def check_data_parallel_args(args: argparse.Namespace) -> bool:
    """Whether ``args`` ask for data parallelism.

    Raises:
        InvalidRequestError: a size < 1, ``mp`` with a size > 1 (replicas run on Ray only), or a size > 1 with
            ``--tensor-parallel-size`` > 1.
    """
    n = args.data_parallel_size
    if n < 1:
        raise InvalidRequestError(f"data_parallel_size: must be >= 1, got {n}", param="data_parallel_size")
    if n > 1 and getattr(args, "tensor_parallel_size", 1) > 1:
        raise InvalidRequestError("data_parallel_size: --data-parallel-size > 1 with --tensor-parallel-size > 1 is "
                                  "not supported yet (run tensor-parallel servers yourself behind kvserve router)",
                                  param="data_parallel_size")
    if n > 1 and args.distributed_executor_backend == "mp":
        raise InvalidRequestError("distributed_executor_backend: data-parallel replicas run as Ray actors; use "
                                  "ray (or kvserve router over servers you start)",
                                  param="distributed_executor_backend")
    return n > 1


def _ray_env() -> None:
    """Ray's environment, set before it starts (Ray reads it then)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report (and no outbound traffic) at init
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray runs its workers at nice 15 by default: replicas would lose every core to any other process
    os.environ.setdefault("RAY_worker_niceness", "0")


def start_ray(address: str | None, num_cpus: float) -> bool:
    """Join the cluster at ``address``, or start a local one (``num_cpus`` logical CPUs) on 127.0.0.1.
    Returns whether a local cluster was started (then :func:`ray.shutdown` stops it)."""
    _ray_env()
    if address is None:
        # NOTE: on Linux Ray replaces a loopback node address with the host's routable one (its "cluster"
        # mode); RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 turns that mode off, so this single-node cluster and its
        # replicas stay on 127.0.0.1. Read when ray is imported: set before.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    runtime_env = {"env_vars": {k: v for k, v in os.environ.items() if k.startswith("KVSERVE_")}}
    if address is not None:
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
        return False
    for attempt in range(_LOCAL_START_TRIES):
        try:
            ray.init(num_cpus=max(1, int(num_cpus + 0.999)), include_dashboard=False,
                     object_store_memory=_OBJECT_STORE_BYTES, _node_ip_address="127.0.0.1", runtime_env=runtime_env,
                     logging_level=logging.WARNING)
            return True
        except Exception as e:
            # NOTE: on a loaded host the driver's first GCS call can pass its deadline while the GCS starts
            # (RaySystemError, ConnectionError), or the raylet its own ("timed out during startup", a bare Exception)
            if not isinstance(e, ray.exceptions.RaySystemError | ConnectionError) and "timed out" not in str(e):
                raise
            ray.shutdown()
            if attempt + 1 == _LOCAL_START_TRIES:
                raise
            logger.warning("starting the local Ray cluster failed (%s); trying again", str(e).splitlines()[0])
    raise AssertionError("unreachable")


def _replica_args(args: argparse.Namespace) -> argparse.Namespace:
    out = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    out.data_parallel_size = 1
    return out


def run_data_parallel(args: argparse.Namespace) -> int:
    """Start the replicas, serve the router until interrupted, stop everything. Returns the exit code.

    Raises:
        InvalidRequestError: the cluster cannot place the replicas within a minute (``param`` names
            ``data_parallel_size``), or ``--host:--port`` cannot be listened on.
    """
    from aiohttp import web

    from kvserve.config import EngineConfig
    from kvserve.distributed.router import Router
    from kvserve.distributed.router_cli import routing_config
    from kvserve.entrypoints.openai.server import check_server_args

    check_server_args(args)
    EngineConfig.from_cli_args(args)  # a bad engine flag fails here, before Ray starts
    n = args.data_parallel_size
    threads = args.num_threads or 1
    local = start_ray(args.ray_address, n * threads)
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kvserve.distributed.ray_replica import replica_actor_class

    actors: list[Any] = []
    pg = None
    try:
        pg = placement_group([{"CPU": float(threads)}] * n, strategy=PLACEMENTS[args.data_parallel_placement])
        ready, _ = ray.wait([pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise InvalidRequestError(
                f"data_parallel_size: the Ray cluster cannot place {n} replicas of {threads} CPU(s) "
                f"({args.data_parallel_placement}); it has {ray.cluster_resources().get('CPU', 0):g} CPUs on "
                f"{len(ray.nodes())} node(s)", param="data_parallel_size")
        cls = replica_actor_class(threads)
        for i in range(n):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            actors.append(cls.options(scheduling_strategy=strategy, name=None).remote(_replica_args(args), i))
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=_REPLICA_START_TIMEOUT_S)
        except ray.exceptions.RayError as e:
            print(f"error: a replica failed to start: {e}", file=sys.stderr, flush=True)
            return 1
        for info in infos:
            print(f"[kvserve] replica {info['index']} on {info['url']} (node {info['node_ip']}, pid {info['pid']})",
                  file=sys.stderr, flush=True)
        config = routing_config(args, [info["url"] for info in infos])
        print(f"[kvserve] data parallel: {n} replicas behind http://{args.host}:{args.port} (policy "
              f"{config.routing.policy}, Ray {'local' if local else args.ray_address})", file=sys.stderr, flush=True)
        try:
            web.run_app(Router(config).app(), host=args.host, port=args.port, handler_cancellation=True,
                        access_log=None, print=None)
        except OSError as e:
            raise InvalidRequestError(f"port: cannot listen on {args.host}:{args.port}: {e.strerror or e}",
                                      param="port") from None
        return 0
    finally:
        _stop(ray, actors)
        if pg is not None:
            remove_placement_group(pg)
        ray.shutdown()  # a local cluster stops with it; a joined one is left as it was


def _stop(ray: Any, actors: list[Any]) -> None:
    """Stop each replica's server (a few seconds), then its actor; dead ones are skipped."""
    pending = []
    for a in actors:
        try:
            pending.append(a.shutdown.remote())
        except Exception:  # noqa: BLE001 - a dead actor: nothing to stop
            continue
    if pending:
        ray.wait(pending, num_returns=len(pending), timeout=20)
    for a in actors:
        ray.kill(a)
