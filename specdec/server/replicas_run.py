"""`specdec serve --replicas N`'s driver: join the cluster at --ray-address or start a local one,
deploy replicas.py's application on --host/--port, and on SIGINT/SIGTERM drain the replicas, then
stop the application (and, for a cluster of its own, Serve and Ray). The replicas and their
routes are replicas.py's; this is the process that starts and stops them."""

from __future__ import annotations

import contextlib
import logging
import os

from ray import serve

from .control import DEV_MODE_VARIABLE
from .replicas import APP_NAME, DEPLOYMENT, PROXY_CALLBACK, PROXY_MIDDLEWARES, application, deployment_options

log = logging.getLogger("specdec.server")

PROXY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


def serve_replicas(args, argv: list[str], prog: str) -> int:
    """`specdec serve --replicas N ...`: join the cluster at --ray-address or start a local
    one, run the application on --host/--port until SIGINT/SIGTERM, then drain and stop (the
    module's docstring)."""
    import signal
    import sys
    import threading

    app = application(argv)
    if not args.ray_address and os.environ.get("RAY_ADDRESS"):
        raise ValueError(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} names a Ray cluster to join, but without "
                         f"--ray-address serve starts a cluster of its own: pass --ray-address "
                         f"{os.environ['RAY_ADDRESS']} to run the replicas there, or unset RAY_ADDRESS")
    hi = args.autoscale[1] if args.autoscale else (args.replicas or 1)
    cpus = deployment_options(args)["ray_actor_options"]["num_cpus"]
    # the proxy's error middleware (proxy.py); a joined cluster's proxies need it in their env
    os.environ.setdefault(PROXY_CALLBACK, PROXY_MIDDLEWARES)
    # Ray Serve's proxy must answer its ready / health checks within 5 / 10 s or it is killed and
    # the start fails ("Proxy actor reported not ready"): on a loaded CPU machine loading a model
    # beside it that happens; a minute each unless the user set them
    for name in PROXY_PATIENCE:
        os.environ.setdefault(name, PROXY_PATIENCE[name])
    env = {"env_vars": {n: os.environ[n] for n in (PROXY_CALLBACK, *PROXY_PATIENCE, DEV_MODE_VARIABLE)
                        if n in os.environ}}
    stop, force = threading.Event(), threading.Event()      # the first signal, a second one

    def on_signal(*_):
        (force if stop.is_set() else stop).set()

    def catch_signals():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
    catch_signals()                 # before Ray starts: a signal at any point stops
    # a local cluster with room for every replica (logical CPUs: Ray only counts them)
    with _ray(args, env, max(os.cpu_count() or 1, int(cpus * hi + 0.999))):
        # again: Ray's core worker put its failure handler (absl's) on SIGTERM, which passes the
        # signal on but then aborts the process 3 s later (its alarm, cancelled here if armed)
        catch_signals()
        signal.alarm(0)
        if stop.is_set():
            return 0
        deployed = False
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            deployed = not stop.is_set()
            if deployed and _deploy(app, stop):
                print(f"{prog}: {'autoscaling' if args.autoscale else hi} replica(s) serving on "
                      f"http://{args.host}:{args.port} (Ray Serve; GET /metrics: every replica's metrics)",
                      file=sys.stderr)
                stop.wait()
            if deployed:        # a replica serves as soon as it is up, maybe before the application runs
                _drain(force, prog)
        finally:
            own = not args.ray_address
            if deployed and not (own and force.is_set()):
                # the replicas stop first, the proxy still relaying their last bytes
                serve.delete(APP_NAME)      # with --ray-address, other applications keep running
            if own:
                serve.shutdown()
    return 0


@contextlib.contextmanager
def _ray(args, env: dict, cpus: int):
    """ray.init on entering: join --ray-address, or start a local cluster of `cpus` logical CPUs
    whatever a `ray start` cluster's address file says; ray.shutdown on leaving. ray.init runs in
    a thread of its own, which no signal interrupts: in the main thread it sets a SIGTERM handler
    that exits in the middle of the start-up, and a KeyboardInterrupt there leaves its processes
    running too; a signal is acted on once it returns. The thread stays until Ray is shut down:
    the processes it starts die with it (Linux's parent-death signal follows the thread)."""
    import threading

    import ray

    started, done, failed = threading.Event(), threading.Event(), []

    def init():
        try:
            if args.ray_address:
                ray.init(address=args.ray_address, logging_level=logging.WARNING, runtime_env=env)
            else:
                ray.init(address="local", num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING,
                         runtime_env=env)
        except BaseException as e:
            failed.append(e)
        started.set()
        done.wait()

    def not_main_thread(record) -> bool:     # Ray's note that it set no SIGTERM handler: ours is set
        return "SIGTERM handler is not set" not in record.getMessage()
    ray_log = logging.getLogger("ray._private.worker")
    ray_log.addFilter(not_main_thread)
    threading.Thread(target=init, name="specdec-ray", daemon=True).start()
    started.wait()
    ray_log.removeFilter(not_main_thread)
    try:
        if failed and isinstance(failed[0], ConnectionError) and args.ray_address:
            raise ValueError(f"{failed[0]}{_auth_hint()}") from None
        if failed:
            raise failed[0]
        yield
    finally:
        ray.shutdown()
        done.set()


def _deploy(app, stop) -> bool:
    """The application deployed -> True once it runs, False when a signal came before (its
    status is polled, as loading the replicas can take minutes)."""
    from ray.serve.schema import ApplicationStatus

    try:
        serve.run_many([serve.RunTarget(target=app, name=APP_NAME, route_prefix="/")],
                       wait_for_applications_running=False)
    except RuntimeError as e:
        raise ValueError(f"the replicas did not start: {_cause(e)}") from None
    while True:
        stopped = stop.wait(0.5)
        status = serve.status().applications[APP_NAME]
        if status.status == ApplicationStatus.RUNNING:        # even if a signal came: it has served
            return True
        if status.status == ApplicationStatus.DEPLOY_FAILED:
            raise ValueError(f"the replicas did not start: {_cause(RuntimeError(status.message))}")
        if stopped:
            return False


def _drain(force, prog: str) -> None:
    """Every replica answers new requests 503 while those in flight finish (the board tells
    them); a second signal (force) stops waiting."""
    import sys

    board = serve.get_deployment_handle("MetricsBoard", APP_NAME)
    told = False
    while not force.is_set():
        try:
            in_flight = board.drain.remote().result(timeout_s=10)
        except Exception as e:      # no board to ask: the replicas stop as they are
            log.warning("could not drain the replicas: %s", e)
            return
        if in_flight == 0:
            return
        if not told:
            print(f"{prog}: finishing {in_flight} request(s) in flight (signal again to stop at once)", file=sys.stderr)
            told = True
        force.wait(0.5)


def _auth_hint() -> str:
    """What to try when joining a cluster failed and this process sent it no token: Ray 2.59+ turns
    token authentication on for clusters that `ray.init()` starts, but a process joining one only
    sends its token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) with
    RAY_AUTH_MODE=token; the cluster then refuses the join as "Unauthenticated"."""
    import os

    if os.environ.get("RAY_AUTH_MODE"):
        return ""
    return (" (a cluster with token authentication, as Ray turns it on for clusters ray.init() starts, "
            "takes processes with RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN or ~/.ray/auth_token)")


def _cause(e: Exception) -> str:
    """The replica's own error: its last 'XError: ...' line, from Ray's deployment failure report
    or, where that names only the deployment ("Failed to update the deployments"), from the
    deployment's status message, which holds the replica's traceback."""
    text = str(e)
    try:
        text += "\n" + serve.status().applications[APP_NAME].deployments[DEPLOYMENT].message
    except Exception:       # no controller or application left to ask: Ray's report alone
        pass
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    found = [ln for ln in lines if "Error: " in ln and not ln.endswith("Traceback (most recent call last):")]
    line = found[-1] if found else lines[0] if lines else type(e).__name__
    head, colon, rest = line.partition(": ")
    if colon and "." in head and " " not in head:      # specdec.model.checkpoint.CheckpointError -> CheckpointError
        line = head.rsplit(".", 1)[1] + colon + rest
    return line[:500]
