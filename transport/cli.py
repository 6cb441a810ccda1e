"""What the two server commands share: `python -m serving` and `python -m transport.frontend`.

Both serve over HTTP/3 and HTTP/1.1 and read the QoS classes of a deployment of models.yaml. Both
check here what would otherwise fail a minute later, after the engines or the back-end start: a
bad file, a half-given certificate, a port that is taken.
"""

from __future__ import annotations

import argparse
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from transport.http3 import Http3Settings
from transport.qos import Tagger
from transport.schedulers import SCHEDULERS
from transport.server import Listen
from transport.stateless_reset import ResetKey
from transport.tls import ensure_certificate
from transport.workers import add_worker_arguments, as_worker


def add_server_arguments(parser: argparse.ArgumentParser, tcp_port: int, udp_port: int) -> None:
    parser.add_argument("--config", default=str(DEFAULT_PATH), help="path to models.yaml")
    parser.add_argument("--deployment", help="a deployment of models.yaml (default: its default)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=tcp_port, help="HTTP/1.1, or with --tls HTTPS (TCP); 0: off"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="serve HTTP/1.1 and HTTP/2 over TLS on --port, with HTTP/3's certificate "
        "(default: plain HTTP/1.1)",
    )
    parser.add_argument("--h3-port", type=int, default=udp_port, help="HTTP/3 (UDP); 0: off")
    parser.add_argument("--cert", help="TLS certificate (PEM); default: a self-signed one")
    parser.add_argument("--key", help="its private key (PEM)")
    parser.add_argument(
        "--scheduler", default="ml", choices=sorted(SCHEDULERS), help="QUIC stream scheduler"
    )
    parser.add_argument(
        "--congestion-control",
        default=Http3Settings.congestion_control,
        choices=["reno", "cubic"],
        help="HTTP/3's congestion controller (default: %(default)s, aioquic's)",
    )
    parser.add_argument(
        "--max-streams",
        type=int,
        default=Http3Settings.max_streams,
        help="concurrent HTTP/3 requests per client connection, QUIC's MAX_STREAMS "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--flush-ms",
        type=float,
        default=Http3Settings.flush_interval * 1000,
        help="HTTP/3: milliseconds a busy connection gathers response bytes before its next "
        "packets; 0 sends after every event-loop pass (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-s",
        type=float,
        default=Listen.drain_s,
        help="on SIGTERM or SIGINT, refuse new requests and give those in flight this long to "
        "finish before they are cut; a second signal cuts at once (default: %(default)s)",
    )
    parser.add_argument(
        "--reset-key-file",
        help="HTTP/3: the secret stateless resets derive from (at least 16 bytes; a Kubernetes "
        "Secret), shared by every front-end host so that any can reset another's connections "
        "(default: one drawn at start, shared by this server's workers)",
    )
    parser.add_argument("--log-level", default="info")
    add_worker_arguments(parser)


@dataclass(frozen=True)
class ServerSetup:
    deployment: Deployment
    listen: Listen
    certfile: str
    keyfile: str
    scheduler: str
    max_streams: int = Http3Settings.max_streams
    congestion_control: str = Http3Settings.congestion_control
    flush_interval: float = Http3Settings.flush_interval
    reset_key: ResetKey | None = None

    def http3(self, tag: Tagger, **settings: int) -> Http3Settings:
        settings.setdefault("max_streams", self.max_streams)
        return Http3Settings(
            self.certfile,
            self.keyfile,
            scheduler=self.scheduler,
            tag=tag,
            congestion_control=self.congestion_control,
            flush_interval=self.flush_interval,
            reset_key=self.reset_key,
            **settings,
        )


def prepare(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerSetup:
    """Logging, the deployment, the certificate and the ports; exits with status 2 and one line
    on the first problem."""
    worker = "" if args.worker_index is None else f"[worker {args.worker_index}] "
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {worker}%(name)s: %(message)s",
    )
    try:
        deployment = load_deployment(args.config, args.deployment, getattr(args, "paths", None))
    except ConfigError as exc:
        parser.exit(2, f"error: {exc}\n")
    if bool(args.cert) != bool(args.key):
        parser.exit(2, "error: --cert and --key go together\n")
    if args.max_streams < 1:
        parser.exit(2, "error: --max-streams must be at least 1\n")
    if not 0 <= args.flush_ms <= 100:
        parser.exit(2, "error: --flush-ms must be between 0 and 100\n")
    if not args.drain_s >= 0:
        parser.exit(2, "error: --drain-s must be at least 0\n")
    if args.workers < 1:
        parser.exit(2, "error: --workers must be at least 1\n")
    for kind, port in (("tcp", args.port), ("udp", args.h3_port)):
        # A worker's ports are its supervisor's, bound and checked there.
        if port and args.worker_index is None and (problem := cannot_listen(args.host, port, kind)):
            parser.exit(2, f"error: cannot listen on {kind} {args.host}:{port}: {problem}\n")
    cert, key = (Path(args.cert), Path(args.key)) if args.cert else ensure_certificate()
    try:
        # A worker's is its supervisor's, so that a restarted worker (or the supervisor, while
        # it stands in) can reset its predecessor's connections.
        reset_key = ResetKey.from_env() or (
            ResetKey.from_file(args.reset_key_file) if args.reset_key_file else ResetKey.generate()
        )
    except (OSError, ValueError) as exc:
        parser.exit(2, f"error: --reset-key-file: {exc}\n")
    listen = Listen(args.host, args.port or None, args.h3_port or None, args.drain_s, args.tls)
    if args.worker_index is not None:
        listen = as_worker(listen, args)
    return ServerSetup(
        deployment,
        listen,
        str(cert),
        str(key),
        args.scheduler,
        args.max_streams,
        args.congestion_control,
        args.flush_ms / 1000,
        reset_key,
    )


def cannot_listen(host: str, port: int, kind: str) -> str | None:
    try:
        if kind == "tcp":
            socket.create_server((host, port)).close()
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.bind((host, port))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
