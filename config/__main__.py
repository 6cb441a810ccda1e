"""`python -m config [models.yaml]`: check a file and print what each deployment resolves to."""

import argparse
import sys
from pathlib import Path

from config.deployment import DEFAULT_PATH, ConfigError, load_with_base, resolve


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", nargs="?", default=str(DEFAULT_PATH))
    args = parser.parse_args()
    path = Path(args.path).resolve()
    try:
        spec, base_dir = load_with_base(path)
        for name in spec.deployments:
            dep = resolve(spec, name, base_dir)
            engines = ", simulated engines" if dep.simulation else ""
            paths = f", clients on path mix {dep.path_mix}" if dep.path_mix else ""
            print(f"{name}: {len(dep.replicas)} replicas, policy {dep.policy.name}{engines}{paths}")
            for replica in dep.replicas:
                print(f"  {replica.name:28} {replica.source}")
        for name, mix in spec.path_mixes.items():
            shares = sum(p.share for p in mix.paths.values())
            print(f"path mix {name}: " + ", ".join(
                f"{path} {p.rtt_s * 1e3:g} ms, {p.rate_bps / 1e6:g} Mbit/s, loss {p.mean_loss:.2%}"
                f" ({p.share / shares:.0%})" for path, p in mix.paths.items()))  # fmt: skip
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
