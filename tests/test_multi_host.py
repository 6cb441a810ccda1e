"""Past one host: engine hosts on TCP, each on a loopback address of its own (127.0.0.2,
127.0.0.3) as a node of its own, with the twin's simulated engines; a front-end on 127.0.0.1
whose placement names them, and the shared link token they ask for. Real processes, real
sockets: only the addresses stand in for hosts."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.dnsmasq import Dnsmasq
from serving.launch import Launched, NotReady, free_port, launch
from tests.support.servers import METERED_KEY, serving_command, write_test_config
from tests.support.tiers import starts

TOKEN = "the-fleets-link-token-0123456789"
HOSTS = ("127.0.0.2", "127.0.0.3")


def placement(ports: list[int]) -> tuple[list[dict], dict]:
    """tiny-s on the first engine host, tiny-m on the second."""
    models = ("tiny-s", "tiny-m")
    entries = [{"model": model, "device": "cpu", "engine_host": f"{host}:{port}"}
               for model, host, port in zip(models, HOSTS, ports, strict=True)]  # fmt: skip
    deployment = {"placement": "two-hosts", "profile": "embedded-measured", "engine": "simulated",
                  "simulation": {"tokenizer": "tiny-s"}, "policy": {"name": "round-robin"},
                  "admission": {"rule": "none"},
                  "engine_args": {"max_model_len": 2048, "max_num_seqs": 64}}  # fmt: skip
    return entries, deployment


def engine_host(
    config: Path, address: str, token_file: Path, log: Path, *extra: str,
    deployment: str = "two-hosts", time_scale: str = "0.1",
) -> Launched:  # fmt: skip
    host, port = address.split(":")
    command = [sys.executable, "-m", "serving.engine_host", "--config", str(config),
               "--deployment", deployment, "--listen", address, "--link-token-file",
               str(token_file), "--time-scale", time_scale, *extra]  # fmt: skip
    launched = launch(f"engine host {address}", command, int(port), "", log, host=host)
    try:
        return launched.listening(60)
    except NotReady as exc:
        launched.stop()
        pytest.fail(str(exc))


@dataclass
class Fleet:
    config: Path
    addresses: list[str]
    hosts: list[Launched]


@pytest.fixture(scope="module")
@starts("multihost")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two engine hosts, up; the test config whose placement `two-hosts` names them."""
    folder = tmp_path_factory.mktemp("fleet")
    ports = [free_port() for _ in HOSTS]
    config = write_test_config(folder, **{"two-hosts": placement(ports)})
    token = folder / "link-token"
    token.write_text(TOKEN + "\n")
    addresses = [f"{h}:{p}" for h, p in zip(HOSTS, ports, strict=True)]
    hosts = [engine_host(config, a, token, folder / f"engines-{a}.log") for a in addresses]
    try:
        yield Fleet(config, addresses, hosts)
    finally:
        for launched in hosts:
            launched.stop()


def front_end(config: Path, token_file: Path, log: Path) -> Launched:
    port = free_port()
    command = serving_command(config, "two-hosts", port, "--h3-port", "0", "--time-scale", "0.1",
                              "--link-token-file", str(token_file))  # fmt: skip
    return launch("front-end", command, port, "/readyz", log)


def test_a_front_end_routes_to_the_engine_hosts_its_placement_names(
    fleet: Fleet, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with front_end(fleet.config, token, tmp_path / "front-end.log") as server:
        server.ready(60)
        served = set()
        for i in range(4):
            body = {"model": "auto", "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"Hello {i}"}]}  # fmt: skip
            answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4
            served.add(answer.headers["x-replica"])
    # Round-robin over one replica on each host; a replica's name says its host.
    assert served == {f"{fleet.addresses[0]}/cpu/tiny-s", f"{fleet.addresses[1]}/cpu/tiny-m"}


def test_a_front_end_with_a_wrong_token_is_refused_and_serves_nothing(
    fleet: Fleet, tmp_path: Path
) -> None:
    wrong = tmp_path / "token"
    wrong.write_text("somebody-elses-link-token-000000")
    server = front_end(fleet.config, wrong, tmp_path / "front-end.log")
    try:
        with pytest.raises(Exception, match="exited"):
            server.ready(60)  # a refusal is a configuration error: it does not start
        said = server.tail(200)
    finally:
        server.stop()
    assert "refused this front-end: wrong link token" in said, said
    for launched in fleet.hosts:
        heard = launched.tail(200)
        assert "refused a front-end at 127.0.0.1:" in heard and "wrong link token" in heard


NAME = "engines.fleet.test"


@dataclass
class DnsFleet:
    dns: Dnsmasq
    config: Path
    token: Path
    port: int
    hosts: list[Launched]

    def replica(self, slot: int) -> str:
        return f"{NAME}:{self.port}#{slot}/cpu/tiny-s"


@pytest.fixture
@starts("multihost")
def dns_fleet(tmp_path: Path) -> Iterator[DnsFleet]:
    """A real DNS server, and an engine host on 127.0.0.2 and on 127.0.0.3 at one port, each
    running tiny-s as the pods of a headless Service `NAME` do, at the profile's own speed."""
    dns = Dnsmasq(tmp_path)
    port = free_port()
    entry = {"model": "tiny-s", "device": "cpu", "engine_host": f"{NAME}:{port}", "hosts": 2}
    deployment = {**placement([0, 0])[1], "placement": "dns"}
    config = write_test_config(tmp_path, dns=([entry], deployment))
    token = tmp_path / "link-token"
    token.write_text(TOKEN)
    hosts: list[Launched] = []
    try:
        for host in HOSTS:
            hosts.append(engine_host(config, f"{host}:{port}", token, tmp_path / f"{host}.log",
                                     "--as", f"{NAME}:{port}", deployment="dns",
                                     time_scale="1"))  # fmt: skip
        yield DnsFleet(dns, config, token, port, hosts)
    finally:
        for launched in hosts:
            launched.stop()
        dns.stop()


def ask(url: str, i: int) -> str:
    """One short request; the replica that served it."""
    body = {"model": "auto", "max_tokens": 2, "messages": [{"role": "user", "content": f"Hi {i}"}]}
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-replica"]


def wait_for(server: Launched, line: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in server.tail(400):
        assert time.monotonic() < deadline, f"no {line!r} in {timeout_s} s:\n{server.tail()}"
        time.sleep(0.1)


def test_a_front_end_finds_hosts_through_dns_and_lets_one_that_left_finish(
    dns_fleet: DnsFleet, tmp_path: Path
) -> None:
    fleet, port = dns_fleet, dns_fleet.port
    fleet.dns.set(NAME, "127.0.0.2")
    front = free_port()
    command = serving_command(fleet.config, "dns", front, "--h3-port", "0",
                              "--link-token-file", str(fleet.token),
                              "--dns-server", fleet.dns.server)  # fmt: skip
    with launch("front-end", command, front, "/readyz", tmp_path / "front-end.log") as server:
        server.ready(60)
        assert {ask(server.url, i) for i in range(4)} == {fleet.replica(0)}

        # A host added to DNS is found, connected to and routed to.
        fleet.dns.set(NAME, "127.0.0.2", "127.0.0.3")
        wait_for(server, f"engine host 127.0.0.3:{port} found behind {NAME}:{port} (slot 1)")
        deadline = time.monotonic() + 10
        while fleet.replica(1) not in {ask(server.url, i) for i in range(2)}:
            assert time.monotonic() < deadline, "never routed to the host that joined"

        # A long stream on 127.0.0.2, which leaves DNS while it runs.
        body = {"model": "auto", "max_tokens": 1500, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "A long story"}]}  # fmt: skip
        lines: list[str] = []
        with httpx.Client(timeout=60) as client:
            for _ in range(4):  # round-robin: the first or the second that lands on slot 0
                stream = client.stream("POST", server.url + "/v1/chat/completions", json=body)
                response = stream.__enter__()
                if response.headers["x-replica"] == fleet.replica(0):
                    break
                stream.__exit__(None, None, None)
            else:
                pytest.fail("no stream landed on the first host")
            reading = threading.Thread(target=lambda: lines.extend(response.iter_lines()))
            reading.start()
            fleet.dns.set(NAME, "127.0.0.3")
            wait_for(server, f"engine host 127.0.0.2:{port} left {NAME}:{port} (slot 0): it "
                             "finishes its 1 requests in flight")  # fmt: skip
            # No new request goes to the host that left...
            assert {ask(server.url, i) for i in range(4)} == {fleet.replica(1)}
            assert reading.is_alive(), "the stream ended before the host left: make it longer"
            reading.join(60)
            stream.__exit__(None, None, None)
        # ...and the one in flight there finished whole, after which its link closed.
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-1] == "data: [DONE]" or lines[-2] == "data: [DONE]", lines[-3:]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        wait_for(server, f"engine link to 127.0.0.2:{port} closed")
        assert "lost" not in server.tail(400).split("(slot 0): it finishes")[-1]


@pytest.fixture
@starts("multihost")
def dns(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def test_front_end_hosts_share_a_keys_limits_by_their_count_in_dns(
    dns: Dnsmasq, tmp_path: Path
) -> None:
    """METERED_KEY may send bursts of 2 (at 0.01 req/s). Two front-end hosts behind one name
    each admit half: a storm of its requests on both lets in at most 2 + 2 - 1 = 3 (the bound
    `serving.key_limits.share` states), where the two alone would let in 4."""
    hosts = ("127.0.0.4", "127.0.0.5")
    dns.set("front-ends.fleet.test", *hosts)
    config = write_test_config(tmp_path)
    with contextlib.ExitStack() as stack:
        servers = []
        for host in hosts:
            port = free_port()
            command = serving_command(config, "embedded-sim", port, "--host", host,
                                      "--h3-port", "0", "--front-ends", "front-ends.fleet.test",
                                      "--dns-server", dns.server)  # fmt: skip
            started = launch(f"front-end {host}", command, port, "/readyz",
                             tmp_path / f"{host}.log", host=host)  # fmt: skip
            servers.append(stack.enter_context(started))
        for server in servers:
            server.ready(60)
            wait_for(server, "2 front-end hosts behind front-ends.fleet.test", 10)
        headers = {"authorization": f"Bearer {METERED_KEY}"}
        body = {"model": "tiny-s", "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hello"}]}  # fmt: skip
        codes = [[httpx.post(s.url + "/v1/chat/completions", json=body, headers=headers,
                             timeout=30).status_code for _ in range(4)]
                 for s in servers]  # fmt: skip
    admitted = [c.count(200) for c in codes]
    assert all(set(c) <= {200, 429} for c in codes), codes
    assert sum(admitted) <= 3 and min(admitted) >= 1, codes
