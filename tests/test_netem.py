"""The link emulator (`netsim.netem`): real kernel TCP and UDP between network namespaces.

Statistical checks against the configured link, each under a seed, measured end to end by
`netsim.probe` from the client's namespace to the server's. They need root and /dev/net/tun,
as the emulator does; without them they are skipped, with the reason.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from netsim.link import DeliveryTrace, GilbertElliott, LinkConfig
from netsim.netem import PREFIX, Netem, Topology

# Root and /dev/net/tun, as the emulator needs: skipped without them, with the reason.
pytestmark = pytest.mark.usefixtures("netns")

PROBE = [sys.executable, "-m", "netsim.probe"]
ROOT = Path(__file__).resolve().parent.parent


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)}


@contextmanager
def emulated(
    links: LinkConfig | list[LinkConfig], topology: Topology = "pair", clients: int = 1
) -> Iterator[Netem]:
    with Netem(links, topology, clients) as net:
        net.popen(net.server, [*PROBE, "serve"], cwd=ROOT)
        yield net


def probe(net: Netem, *args: str, client: int = 0, to: str | None = None) -> dict[str, float]:
    """Runs a probe from a client namespace, retrying while the server is still starting."""
    command = [*PROBE, *args, "--to", to or net.server_address]
    for _ in range(50):
        done = net.popen(net.clients[client], command, cwd=ROOT, stdout=subprocess.PIPE)
        out, _ = done.communicate(timeout=120)
        if done.returncode == 0:
            return json.loads(out)  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise AssertionError(f"probe {args} never succeeded")


def test_round_trip_time_is_the_configured_delay() -> None:
    with emulated(LinkConfig(rate_bps=10e6, delay_s=0.025)) as net:
        measured = probe(net, "rtt", "--count", "20")["median_ms"]
    assert measured == pytest.approx(50.0, abs=2 + 0.05 * 50)


def test_tcp_goodput_is_the_configured_rate() -> None:
    with emulated(LinkConfig(rate_bps=10e6, delay_s=0.01, seed=1)) as net:
        measured = probe(net, "goodput", "--bytes", "3000000")["mbps"]
    assert measured == pytest.approx(10.0, rel=0.10)


def test_iid_loss_is_the_configured_share(tmp_path: Path) -> None:
    stats = tmp_path / "link.json"
    link = LinkConfig(rate_bps=100e6, delay_s=0.002, loss=0.02, seed=3)
    with Netem(link, stats_path=stats) as net:
        net.popen(net.server, [*PROBE, "serve"], cwd=ROOT)
        measured = probe(net, "loss", "--count", "20000", "--rate", "5000")["loss"]
    # The link drops its share of what it is offered; that is the model, and exact to sampling.
    directions = json.loads(stats.read_text())["directions"].values()
    offered = sum(d["sent"] + d["dropped"] for d in directions)
    assert sum(d["dropped"] for d in directions) / offered == pytest.approx(0.02, abs=0.002)
    # End to end the probe sees at least that. It may see more, never by design: on two cores
    # busy with the rest of the suite, runs measured 2.3%, 2.6% (CI), 2.7% and 5.8% (a starved
    # forwarder overflows the TUN queue), so the upper bound is loose.
    assert 0.018 <= measured <= 0.08


def test_gilbert_elliott_slots_give_their_mean_loss() -> None:
    # 0.2 ms slots, so that the run's 1-2 s hold thousands of good and bad periods: in virtual
    # time, 30 seeds of this gave 0.237-0.269.
    bursts = GilbertElliott(good_slots=4, bad_slots=4, bad_loss=0.5, slot_s=0.0002)
    with emulated(LinkConfig(rate_bps=100e6, delay_s=0.002, bursts=bursts, seed=4)) as net:
        measured = probe(net, "loss", "--count", "20000")["loss"]
    assert measured == pytest.approx(bursts.mean_loss, rel=0.10)


def test_a_delivery_trace_sets_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "cell.trace"
    # 10 ms that carry 1, 0, 2, 1, 0, 1, 1, 2, 0 and 1 MTUs: 9 MTUs a loop, 10.8 Mbit/s.
    path.write_text("1\n3\n3\n4\n6\n7\n8\n8\n10\n")
    trace = DeliveryTrace.read(path)
    with emulated(LinkConfig(trace=trace, delay_s=0.01, seed=1)) as net:
        measured = probe(net, "goodput", "--bytes", "3000000")["mbps"]
    assert measured == pytest.approx(trace.mean_rate_bps / 1e6, rel=0.10)


def test_a_chain_crosses_both_links_and_a_star_gives_each_client_its_own() -> None:
    chain = [LinkConfig(delay_s=0.010), LinkConfig(delay_s=0.020)]
    with emulated(chain, "chain") as net:
        assert probe(net, "rtt", "--count", "5")["median_ms"] == pytest.approx(60, abs=5)
        assert net.middle_address is not None
    star = [LinkConfig(delay_s=0.005), LinkConfig(delay_s=0.030)]
    with emulated(star, "star", clients=2) as net:
        near = probe(net, "rtt", "--count", "5", client=0)["median_ms"]
        far = probe(net, "rtt", "--count", "5", client=1)["median_ms"]
    assert (near, far) == pytest.approx((10, 60), abs=5)


def test_traffic_cannot_leave_the_emulated_network() -> None:
    with Netem(LinkConfig()) as net:
        outside = net.popen(
            net.client,
            [sys.executable, "-c", "import socket; socket.create_connection(('1.1.1.1', 53), 2)"],
            stderr=subprocess.PIPE,
        )
        _, err = outside.communicate(timeout=30)
    assert outside.returncode != 0
    assert b"unreachable" in err


def shell(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "netsim.netem", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_namespaces(before: set[str], count: int) -> set[str]:
    for _ in range(100):
        made = namespaces() - before
        if len(made) >= count:
            return made
        time.sleep(0.1)
    raise AssertionError("the shell never made its namespaces")


def test_the_shell_runs_cmd_behind_the_link_and_says_where_the_server_is() -> None:
    run = shell("--delay-ms", "5", "--", "sh", "-c", "echo $NETEM_SERVER; exit 3")
    out, err = run.communicate(timeout=60)
    assert run.returncode == 3
    assert out.strip() == "10.77.255.1"
    assert "server at 10.77.255.1" in err


def test_the_shell_cleans_up_after_its_command_is_killed() -> None:
    before = namespaces()
    run = shell("--server-cmd", "sleep 600", "--", "sleep", "600")
    made = wait_for_namespaces(before, 2)
    client = next(name for name in made if name.endswith("-client0"))

    def the_command() -> int | None:
        """The client's `sleep 600`: not whatever else the namespace holds at the moment (the
        first pid listed was once a helper, and killing it ended the shell with 1)."""
        pids = subprocess.run(["ip", "netns", "pids", client], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with suppress(OSError):  # gone meanwhile
                if Path(f"/proc/{pid}/cmdline").read_bytes() == b"sleep\x00600\x00":
                    return int(pid)
        return None

    for _ in range(100):
        if (command := the_command()) is not None:
            break
        time.sleep(0.1)
    assert command is not None, "the client's command never ran"
    os.kill(command, signal.SIGKILL)
    assert run.wait(timeout=30) == 128 + signal.SIGKILL
    assert not namespaces() & made


def test_a_new_emulator_removes_what_a_killed_one_left() -> None:
    before = namespaces()
    run = shell("--server-cmd", "sleep 600", "--", "sleep", "600")
    made = wait_for_namespaces(before, 2)
    time.sleep(0.5)  # its commands started
    run.send_signal(signal.SIGKILL)
    run.wait(timeout=30)
    assert made <= namespaces()  # a crash leaves them behind...
    with Netem(LinkConfig()):
        assert not namespaces() & made  # ...until the next emulator starts
    assert not namespaces() & made


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate-mbps", "-5"], "rate"),
        (["--loss", "1.5"], "loss rate must be in [0, 1]"),
        (["--trace", "/nonexistent.trace"], "cannot read the delivery trace"),
        (["--ge-good-slots", "0.2"], "at least one slot"),
        (["--topology", "pair", "--clients", "3"], "star"),
        ([], "give a command"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_made(flags: list[str], message: str) -> None:
    before = namespaces()
    run = shell(*flags, *(["--", "true"] if flags else []))
    _, err = run.communicate(timeout=30)
    assert run.returncode == 2
    assert message in err
    assert "Traceback" not in err
    assert namespaces() == before


def test_the_shell_refuses_to_run_without_root() -> None:
    run = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            "from netsim.netem import main; raise SystemExit(main(['--', 'true']))",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 2
    assert "run as root" in run.stderr
