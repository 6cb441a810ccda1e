"""The arrival rate across front-end hosts (`serving.fleet_rate`): the levels other hosts'
workers send add to a worker's own, each decayed from when it was heard; its own host's do
not (they are in its shared view already); and they cross a real engine host's link on TCP."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from router.features import ArrivalRateEstimator
from serving.engine_host import link_server
from serving.engines.engine_link import EngineLink
from serving.fleet_rate import HEARD_S, FleetArrivalRate, exchange
from serving.launch import free_port
from tests.test_engine_link import engines


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_other_hosts_levels_add_up_decayed_and_this_hosts_do_not() -> None:
    clock = Clock()
    rate = FleetArrivalRate(ArrivalRateEstimator(), 0, "host-a", clock)
    rate.heard("host-b/0", 12.0)
    rate.heard("host-b/1", 10.0)
    rate.heard("host-a/1", 50.0)  # a worker of this host: counted through shared memory
    rate.heard("host-b/0", 14.0)  # heard again (through another engine host): the latest
    assert rate.value(clock.now) == pytest.approx(24.0)
    clock.now += 0.5
    assert rate.value(clock.now) == pytest.approx(24.0 * math.exp(-0.5 / rate.horizon_s))
    assert rate.level(clock.now) == 0.0  # what it sends is its own alone
    rate.observe(clock.now)
    assert rate.level(clock.now) == pytest.approx(0.1)
    clock.now += HEARD_S  # a sender not heard for a second has left
    assert rate.others(clock.now) == 0.0


async def test_levels_cross_an_engine_host_to_the_other_front_ends(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    token = "a-link-token-of-some-length"
    async with engines(tmp_path) as replicas, link_server(replicas, address, token):
        hosts = {name: FleetArrivalRate(ArrivalRateEstimator(), 0, name) for name in "ab"}
        links = {name: EngineLink(address, token) for name in hosts}
        for link in links.values():
            await link.connect()
        tasks = [asyncio.create_task(exchange(hosts[n], lambda n=n: [links[n]])) for n in hosts]
        try:
            now = hosts["a"].clock()
            for i in range(30):  # 30 arrivals at a: a level of about 3 req/s
                hosts["a"].observe(now + i * 0.001)
            own = hosts["a"].level(hosts["a"].clock())
            async with asyncio.timeout(5):
                while hosts["b"].others(hosts["b"].clock()) < 0.95 * own:
                    await asyncio.sleep(0.05)
            assert hosts["b"].value(hosts["b"].clock()) == pytest.approx(own, rel=0.05)
            assert hosts["a"].others(hosts["a"].clock()) == 0.0  # b sent nothing but 0s
            # A frame of another shape (a front-end of another version) is not passed on, and
            # takes no link down.
            for bad in (["rate", "c/0"], ["rate", "c/0", float("nan")], ["rate", 7, 1.0]):
                links["a"].send(bad)
            links["a"].send(["rate", "c/0", 5.0])  # a well-formed one is: b hears c's 5 req/s
            async with asyncio.timeout(5):
                while hosts["b"].others(hosts["b"].clock()) < own + 4.9:
                    await asyncio.sleep(0.02)
            assert hosts["b"].others(hosts["b"].clock()) == pytest.approx(own + 5.0, rel=0.02)
            assert all(link.connected for link in links.values())
        finally:
            for task in tasks:
                task.cancel()
            for link in links.values():
                link.close()
