"""`python -m serving --deployment embedded`: serve a deployment of models.yaml over HTTP/3 (UDP)
and HTTP/1.1 (TCP) at once."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from functools import partial
from pathlib import Path

from config import ConfigError, Deployment
from router.policies import POLICIES
from serving.engine_host import hosted
from serving.engines.engine_link import link_address, read_link_token
from serving.fleet_rate import front_end_host
from serving.metrics import count_lost
from serving.shared_view import SharedView
from transport.cli import add_server_arguments, prepare
from transport.limits import DEFAULT_MAX_BODY_BYTES
from transport.qos import QosClassifier
from transport.server import DualServer, Listen, serve_forever
from transport.stateless_reset import ResetKey
from transport.workers import supervise


def _policy_name(name: str) -> str:
    """A policy name, or two joined by +, each a known one."""
    unknown = [part for part in name.split("+") if part not in POLICIES]
    if unknown or name.count("+") > 1:
        raise argparse.ArgumentTypeError(
            f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))}, or A+B)"
        )
    return name


def build_parser() -> argparse.ArgumentParser:
    """`python -m serving`'s arguments (tests/test_manifests.py parses the manifests' with it)."""
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    add_server_arguments(parser, tcp_port=8000, udp_port=8443)
    parser.add_argument(
        "--hard-deadlines",
        action="store_true",
        help="reset a response stream when its class deadline passes (default: the deadline "
        "only orders streams; the gateway already enforces it up to the first token)",
    )
    parser.add_argument(
        "--policy",
        type=_policy_name,
        help="override the deployment's: one of " + ", ".join(sorted(POLICIES)) + ", or A+B "
        "(A chooses the model, B its replica: dqn+prefix-precise)",
    )
    parser.add_argument(
        "--policy-file",
        type=Path,
        metavar="NPZ",
        help="route with this trained DQN in place of the deployment's (policy.path and "
        "net_path): to compare two policies live on one deployment",
    )
    parser.add_argument(
        "--paths",
        metavar="MIX",
        help="the path mix of models.yaml that the clients come over: routes with the "
        "deployment's network-aware policy (policy.net_path), where it names one",
    )
    parser.add_argument(
        "--admission",
        choices=["deadline", "none"],
        help="override the deployment's admission control: deadline sheds (429) what no replica "
        "can start within its class's budget; none dispatches everything",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        help="simulated engines only: multiply every time of the latency profile by this "
        "(0.001: engines a thousand times faster, to load the front-end alone)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="refuse larger request bodies with a 413",
    )
    parser.add_argument(
        "--request-log",
        default="-",
        help="where the JSON line of each request goes: a file (appended), '-' for stderr, "
        "or 'off'",
    )
    parser.add_argument(
        "--loop",
        choices=["asyncio", "uvloop"],
        default="asyncio",
        help="the event loop: uvloop delivered 9%% more token events a second over HTTP/1.1 and "
        "9%% fewer over HTTP/3 (docs/results/frontend-capacity.md)",
    )
    parser.add_argument(
        "--separate-engines",
        action="store_true",
        help="run the engines in a process of their own (serving.engine_host), reached over the "
        "engine link, even with one worker; with several and engines that are not remote, "
        "they always are",
    )
    parser.add_argument(
        "--link-token-file",
        help="the shared secret the engine hosts of other hosts ask for (placement entries with "
        "engine_host; a mounted Kubernetes Secret)",
    )
    parser.add_argument(
        "--dns-server",
        metavar="HOST:PORT",
        help="resolve the engine hosts behind DNS names (placement entries with hosts:) with "
        "this server alone (default: the system's resolver, a pod's cluster DNS)",
    )
    parser.add_argument(
        "--front-ends",
        metavar="NAME",
        help="the DNS name of every front-end host (a headless Service): each admits its share "
        "of every key's limits, 1/N where the name has N addresses (docs/multi-host.md)",
    )
    parser.add_argument(
        "--no-rate-exchange",
        dest="rate_exchange",
        action="store_false",
        help="with engine hosts on other hosts: route on this host's arrival rate alone, not "
        "the whole fleet's that the front-end hosts exchange through them",
    )
    # What the supervisor tells a worker (not for people): where the engine host's link is, and
    # the folder of what the workers share (`serving.shared_view`).
    parser.add_argument("--engine-host", help=argparse.SUPPRESS)
    parser.add_argument("--shared-view", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    setup = prepare(parser, args)
    deployment = setup.deployment
    try:
        if args.admission is not None:
            deployment = deployment.with_admission(args.admission)
        if args.time_scale is not None:
            deployment = deployment.with_time_scale(args.time_scale)
        if args.policy_file is not None:
            deployment = deployment.with_policy_file(args.policy_file)
    except ConfigError as exc:
        parser.error(str(exc))
    link_token = None
    if args.link_token_file is not None:
        try:
            link_token = read_link_token(args.link_token_file)
        except (OSError, ValueError) as exc:
            parser.error(f"--link-token-file: {exc}")
    elif deployment.engine_hosts:
        parser.error(
            f"deployment {deployment.name} has replicas on engine hosts "
            f"({', '.join(deployment.engine_hosts)}): give their --link-token-file"
        )
    if args.dns_server is not None and isinstance(link_address(args.dns_server), str):
        parser.error(f"--dns-server: {args.dns_server!r} is not HOST:PORT")
    front_end_host()  # one id for this host's workers, which inherit it
    if args.worker_index is None and (args.workers > 1 or args.separate_engines):
        return _supervise(args, deployment, setup.listen, setup.reset_key)
    _route_request_log(args.request_log)
    # Imported after the checks: it pulls in the engine stack.
    from serving.app import build_app

    try:
        app = build_app(
            deployment, args.policy, args.max_body_bytes, args.worker_index, args.engine_host,
            SharedView.attach(args.shared_view, deployment) if args.shared_view else None,
            link_token, args.dns_server, args.front_ends, args.rate_exchange,
        )  # fmt: skip
    except ValueError as exc:  # the policy cannot be built: a bad name, file or model
        parser.error(f"policy: {exc}")
    classifier: QosClassifier = app.state.classifier
    h3 = setup.http3(
        partial(classifier.tag, soft_deadlines=not args.hard_deadlines),
        max_body_bytes=args.max_body_bytes,
    )
    # The request log replaces uvicorn's access log: one line per request, over either protocol.
    server = DualServer(
        app, setup.listen, h3, log_level=args.log_level, access_log=False, drain=app.state.drain
    )
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve_forever(server, on_ready=_announce))
    return 0


def _forget(view: SharedView, index: int, pid: int) -> None:
    """Worker `index` (process `pid`) died: what it held leaves the shared view, the requests
    it held open count as ended with it, and its live gauges leave /metrics. Its counters stay:
    what it served was served."""
    from prometheus_client import multiprocess

    count_lost(view.metrics, pid, view.clear(index))
    multiprocess.mark_process_dead(pid, str(view.metrics))


def _supervise(
    args: argparse.Namespace, deployment: Deployment, listen: Listen, reset_key: ResetKey | None
) -> int:
    """Run the workers (and the engine host, for engines that are not remote) until stopped."""
    view = SharedView.create(deployment, args.workers)
    argv = [a for a in sys.argv[1:] if a != "--separate-engines"]
    argv += ["--shared-view", str(view.folder)]
    env = {"PROMETHEUS_MULTIPROC_DIR": str(view.metrics)}
    forget = partial(_forget, view)
    try:
        # Else every worker is a client of the servers or engine hosts themselves.
        if deployment.run_by(None).replicas:
            host = ["--config", args.config, "--log-level", args.log_level]
            host += ["--deployment", deployment.name]
            host += ["--time-scale", str(args.time_scale)] if args.time_scale is not None else []
            with hosted(host) as link:
                argv += ["--engine-host", link]
                return supervise("serving", argv, listen, args.workers, forget, env, reset_key)
        return supervise("serving", argv, listen, args.workers, forget, env, reset_key)
    finally:
        view.close(remove=True)


def _route_request_log(where: str) -> None:
    """Request lines are bare JSON, one per line, apart from the server's other logging."""
    request_log = logging.getLogger("serving.requests")
    request_log.propagate = False
    if where == "off":
        request_log.setLevel(logging.WARNING)
        return
    request_log.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr) if where == "-" else logging.FileHandler(where)
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log.addHandler(handler)


def _announce(server: DualServer) -> None:
    host = server.listen.host
    if server.tcp_port and server.listen.tls:
        logging.info("HTTP/1.1 and HTTP/2 on https://%s:%d", host, server.tcp_port)
    elif server.tcp_port:
        logging.info("HTTP/1.1 on http://%s:%d", host, server.tcp_port)
    if server.udp_port:
        logging.info("HTTP/3 on https://%s:%d (UDP)", host, server.udp_port)


if __name__ == "__main__":
    sys.exit(main())
