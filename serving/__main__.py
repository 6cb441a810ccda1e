"""`python -m serving --deployment embedded`: serve a deployment of models.yaml over HTTP/1.1."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from config import DEFAULT_PATH, ConfigError, load_deployment
from router.policies import POLICIES
from transport.limits import DEFAULT_MAX_BODY_BYTES


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument("--deployment", help="a deployment of models.yaml (default: its default)")
    parser.add_argument("--config", default=str(DEFAULT_PATH), help="path to models.yaml")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
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
    if problem := _cannot_listen(args.host, args.port):
        # uvicorn binds only after the engines start; say so now, not a minute from now.
        print(f"error: cannot listen on {args.host}:{args.port}: {problem}", file=sys.stderr)
        return 2
    # Imported after the checks: it pulls in the engine stack.
    from serving.app import build_app

    app = build_app(deployment, args.policy, args.max_body_bytes)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    return 0


def _cannot_listen(host: str, port: int) -> str | None:
    try:
        with socket.create_server((host, port)):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


if __name__ == "__main__":
    sys.exit(main())
