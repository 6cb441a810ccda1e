"""The end-to-end benchmark of Chuppala (2024), `experiments.transport_macro`, and its
co-simulation (`experiments.harness.cosim`): the plumbing, in virtual time, on a few requests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from config import load_deployment
from experiments import transport_macro
from experiments.harness.cosim import STACKS, CoSimulation
from netsim.link import LinkConfig
from router.policies import Static
from transport.tls import ensure_certificate
from workloads import Request
from workloads.arrivals import Poisson
from workloads.generate import WorkloadSpec

DEPLOYMENT = load_deployment(name="paper-4gpu-sim").with_admission("none")
LINK = LinkConfig(rate_bps=5e6, delay_s=0.025, loss=0.005, seed=1)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return ensure_certificate(tmp_path_factory.mktemp("certs"), deterministic=True)


def ten_requests(seed: int = 0) -> list[Request]:
    return transport_macro.workload(WorkloadSpec(Poisson(2.0)), seed, 5.0)[:10]


def run(stack: str, certificate: tuple[Path, Path], reqs: list[Request], link: LinkConfig = LINK):
    sim = CoSimulation(stack, DEPLOYMENT, Static("opt-1.3b"), reqs, link, certificate)
    return sim, sim.run(horizon=60.0)


def test_the_classes_follow_the_task() -> None:
    reqs = transport_macro.workload(WorkloadSpec(Poisson(20.0)), 0, 10.0)
    for r in reqs:
        assert (r.qos_class == "real-time") == (r.task == transport_macro.REAL_TIME_TASK)
        assert (r.qos_class == "long") == (r.prompt_tokens == transport_macro.LARGE_PROMPT_TOKENS)
    assert {r.qos_class for r in reqs} == {"real-time", "free-tier", "long"}


@pytest.mark.parametrize("stack", STACKS)
def test_every_stack_delivers_every_token_after_the_link_delays_it(stack, certificate) -> None:
    reqs = ten_requests()
    _, done = run(stack, certificate, reqs)
    assert len(done) == len(reqs)
    for d in done:
        assert d.status == 200 and d.model == "opt-1.3b"
        assert d.tokens == d.request.max_tokens
        assert d.arrived is not None and d.first_token is not None and d.done is not None
        # Up one way, and the first token down the other: at least the round trip.
        assert d.arrived - d.sent >= LINK.delay_s
        assert d.sent + 2 * LINK.delay_s <= d.first_token <= d.done


def test_a_tcp_connection_per_request_pays_a_handshake_more(certificate) -> None:
    reqs = ten_requests()
    h1 = {d.request.request_id: d.arrived - d.sent for d in run("h1-tls", certificate, reqs)[1]}
    h2 = {d.request.request_id: d.arrived - d.sent for d in run("h2-tls", certificate, reqs)[1]}
    # TCP's and QUIC's (TLS's) handshakes: two round trips before the request goes up.
    assert all(h1[rid] >= h2[rid] + 4 * LINK.delay_s for rid in h1)


def test_a_run_is_reproducible_under_its_seed(certificate) -> None:
    reqs = ten_requests(seed=3)
    first = [(d.first_token, d.done) for d in run("edf", certificate, reqs)[1]]
    again = [(d.first_token, d.done) for d in run("edf", certificate, reqs)[1]]
    assert first == again


def test_a_saturated_link_fails_requests_at_the_client_not_at_the_server(certificate) -> None:
    # Twenty requests at once over 200 kbit/s: the engines keep the SLO, the link cannot.
    reqs = [dataclasses.replace(r, arrival=0.0) for r in ten_requests() + ten_requests(seed=1)]
    reqs = [dataclasses.replace(r, request_id=f"r{i}") for i, r in enumerate(reqs)]
    slow = LinkConfig(rate_bps=2e5, delay_s=0.025, seed=1)
    _, done = run("rr", certificate, reqs, slow)
    assert all(d.server_slo_met for d in done)
    met = [transport_macro.met_at_client(DEPLOYMENT, d) for d in done]
    assert not any(met)
    assert transport_macro.score(DEPLOYMENT, done[0]) == 0.0


def test_the_cli_writes_its_tables(tmp_path, capsys) -> None:
    assert transport_macro.main([
        "--stacks", "rr,h2-tls", "--policies", "opt-125m-only,dqn", "--seeds", "1",
        "--rates", "1", "--rate-seconds", "2", "--seconds", "2", "--jobs", "1",
        "--out", str(tmp_path),
    ]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "Table 3 (stable)" in out and "Table 4 (unpredictable)" in out
    assert {p.name for p in tmp_path.iterdir()} >= {"runs.csv", "cells.csv", "tables.png"}
    rows = transport_macro.read_rows(tmp_path / "runs.csv")
    assert len(rows) == 2 * 2 * 2  # stacks x policies x workloads
    assert all(0.0 <= float(r["score"]) <= 1.0 for r in rows)
    # A report redraws the same tables from the rows alone.
    assert (
        transport_macro.main(
            ["--report", "--policies", "opt-125m-only,dqn", "--out", str(tmp_path)]
        )
        == 0
    )
    assert "Table 3 (stable)" in capsys.readouterr().out


def test_bad_arguments_are_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        transport_macro.main(["--stacks", "quic"])
    assert exit_.value.code == 2
    assert "unknown stacks" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rates", "abc"], "--rates takes numbers"),
        (["--rate-seconds", "nan"], "finite numbers above 0"),
        (["--seconds", "inf"], "finite numbers above 0"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--report", "--out", "/nonexistent/transport_macro"], "no run to report"),
    ],
)
def test_bad_numbers_and_a_missing_run_are_refused_with_the_reason(args, says, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        transport_macro.main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
