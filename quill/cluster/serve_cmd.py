"""`quill serve --ray`: start (or join) a Ray cluster, deploy quill's Serve application, serve
until SIGTERM/SIGINT, then take it down."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

logger = logging.getLogger("quill.cluster")


def cluster_options(args, cpu_count: int | None = None):
    """ClusterOptions from `quill serve --ray` flags. Without --threads each replica gets an equal
    share of this machine's cores (at least one); Ray reserves that many CPUs per replica."""
    from quill.cluster.deployments import ClusterOptions

    replicas = args.replicas or ClusterOptions.replicas
    if args.threads is None:
        args.threads = max(1, (cpu_count or os.cpu_count() or 1) // replicas)
    return ClusterOptions(
        serve_args=args,
        replicas=replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests or ClusterOptions.target_ongoing_requests,
        max_ongoing_requests=args.max_ongoing_requests or 2 * args.max_num_seqs,
        router=args.router or ClusterOptions.router,
        imbalance_threshold=ClusterOptions.imbalance_threshold if args.route_imbalance is None else args.route_imbalance,
        replica_cpus=float(args.threads),
    )


def start(options, host: str, port: int, address: str | None = None) -> None:
    """Connect to (or start) Ray, start Serve's HTTP proxy on host:port, deploy and wait until
    every replica is up."""
    import ray
    from ray import serve

    from quill.cluster.deployments import build_app

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, namespace="quill", logging_level=logging.WARNING)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(options), name=options.app_name, route_prefix="/", blocking=False)


def stop(app_name: str, shutdown_ray: bool) -> None:
    import ray
    from ray import serve

    try:
        if shutdown_ray:
            serve.shutdown()
        else:
            serve.delete(app_name)
    finally:
        if shutdown_ray:
            ray.shutdown()


def run_ray(args) -> int:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as exc:
        print(f"quill serve --ray needs Ray Serve ({exc}): pip install 'quill[ray]'", file=sys.stderr)
        return 2
    if args.router == "ray-prefix":
        import importlib

        from quill.cluster.deployments import RAY_PREFIX_ROUTER

        try:
            importlib.import_module(RAY_PREFIX_ROUTER.rsplit(".", 1)[0])
        except ImportError as exc:
            print(f"quill serve: --router ray-prefix needs pyarrow ({exc}): pip install pyarrow", file=sys.stderr)
            return 2
    try:
        options = cluster_options(args)
        from quill.server.serve_cmd import engine_config

        engine_config(args)  # a bad engine flag fails here, once, not in every replica
    except (TypeError, ValueError) as exc:
        print(f"quill serve: {exc}", file=sys.stderr)
        return 2
    try:
        start(options, args.host, args.port, args.ray_address)
    except Exception as exc:  # noqa: BLE001 - a replica that fails to load, a port in use: say it and stop
        print(f"quill serve --ray: the application did not start: {type(exc).__name__}: {exc}", file=sys.stderr)
        stop(options.app_name, shutdown_ray=args.ray_address is None)
        return 1
    # After ray.init, which installs its own SIGTERM handler (exit at once, status 15).
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    scaling = (f"autoscaling {options.replicas}..{options.max_replicas} replicas at {options.target_ongoing_requests:g} "
               f"ongoing requests each" if options.autoscaling else f"{options.replicas} replica(s)")
    print(f"quill: serving on Ray Serve at {url}/v1 ({scaling}, {args.threads} thread(s) each, router "
          f"{options.router}; metrics {url}/metrics)", flush=True)
    while not stopping.wait(0.5):  # wake up now and then: Ray's threads may take the signal, and the
        pass                       # main thread runs the Python handler only when it is not blocked
    logger.info("stopping the Serve application")
    stop(options.app_name, shutdown_ray=args.ray_address is None)
    return 0
