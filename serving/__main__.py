"""`python -m serving --deployment embedded`: serve a deployment of models.yaml over HTTP/3 (UDP)
and HTTP/1.1 (TCP) at once."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from functools import partial
from pathlib import Path

from config import DEFAULT_PATH, ConfigError, load_deployment
from router.policies import POLICIES
from transport.http3 import Http3Settings
from transport.limits import DEFAULT_MAX_BODY_BYTES
from transport.qos import QosClassifier
from transport.schedulers import SCHEDULERS
from transport.server import DualServer, Listen, serve_forever
from transport.tls import ensure_certificate


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument("--deployment", help="a deployment of models.yaml (default: its default)")
    parser.add_argument("--config", default=str(DEFAULT_PATH), help="path to models.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP/1.1 (TCP); 0 turns it off")
    parser.add_argument("--h3-port", type=int, default=8443, help="HTTP/3 (UDP); 0 turns it off")
    parser.add_argument("--cert", help="TLS certificate (PEM); default: a self-signed one")
    parser.add_argument("--key", help="its private key (PEM)")
    parser.add_argument(
        "--scheduler", default="ml", choices=sorted(SCHEDULERS), help="QUIC stream scheduler"
    )
    parser.add_argument(
        "--hard-deadlines",
        action="store_true",
        help="reset a response stream when its class deadline passes (default: the deadline "
        "only orders streams; the gateway already enforces it up to the first token)",
    )
    parser.add_argument("--policy", choices=sorted(POLICIES), help="override the deployment's")
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="refuse larger request bodies with a 413",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        deployment = load_deployment(args.config, args.deployment)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if bool(args.cert) != bool(args.key):
        print("error: --cert and --key go together", file=sys.stderr)
        return 2
    for kind, port in (("tcp", args.port), ("udp", args.h3_port)):
        if port and (problem := _cannot_listen(args.host, port, kind)):
            # The servers bind only after the engines start; say so now, not a minute from now.
            print(f"error: cannot listen on {kind} {args.host}:{port}: {problem}", file=sys.stderr)
            return 2
    cert, key = (Path(args.cert), Path(args.key)) if args.cert else ensure_certificate()
    # Imported after the checks: it pulls in the engine stack.
    from serving.app import build_app

    app = build_app(deployment, args.policy, args.max_body_bytes)
    classifier: QosClassifier = app.state.classifier
    h3 = Http3Settings(
        certfile=str(cert),
        keyfile=str(key),
        scheduler=args.scheduler,
        max_body_bytes=args.max_body_bytes,
        classify=partial(classifier.stream_spec, soft_deadlines=not args.hard_deadlines),
    )
    listen = Listen(args.host, args.port or None, args.h3_port or None)
    server = DualServer(app, listen, h3, log_level=args.log_level)
    asyncio.run(serve_forever(server, on_ready=_announce))
    return 0


def _announce(server: DualServer) -> None:
    host = server.listen.host
    if server.tcp_port:
        logging.info("HTTP/1.1 on http://%s:%d", host, server.tcp_port)
    if server.udp_port:
        logging.info("HTTP/3 on https://%s:%d (UDP)", host, server.udp_port)


def _cannot_listen(host: str, port: int, kind: str) -> str | None:
    try:
        if kind == "tcp":
            socket.create_server((host, port)).close()
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.bind((host, port))
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


if __name__ == "__main__":
    sys.exit(main())
