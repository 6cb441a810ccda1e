"""`python -m config [models.yaml]`: check a file and print what each deployment resolves to."""

import argparse
import sys
from pathlib import Path

from config.deployment import DEFAULT_PATH, ConfigError, load, resolve


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", nargs="?", default=str(DEFAULT_PATH))
    args = parser.parse_args()
    path = Path(args.path).resolve()
    try:
        spec = load(path)
        for name in spec.deployments:
            dep = resolve(spec, name, path.parent)
            engines = ", simulated engines" if dep.simulation else ""
            print(f"{name}: {len(dep.replicas)} replicas, policy {dep.policy.name}{engines}")
            for replica in dep.replicas:
                print(f"  {replica.name:28} {replica.source}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
