"""`python -m workloads.replay` against the real embedded server: every request sent is accounted
for, over HTTP/3, HTTP/1.1 and through the edge front-end."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from itertools import cycle
from pathlib import Path

import pytest

from serving.launch import free_port
from tests.support.servers import CERT, PREMIUM_KEY, PYTHON, ROOT, Server
from workloads.arrivals import Poisson
from workloads.generate import TaskShape, WorkloadSpec, requests
from workloads.request import load_requests, save_requests

SHORT = ["--rate", "6", "--num-requests", "12", "--output-tokens", "4:12", "--no-progress"]


def replay(out: Path, *args: str, api_key: str | None = None) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "QOS_PREMIUM_KEY"}
    cmd = [PYTHON, "-m", "workloads.replay", *SHORT, "--out", str(out), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert out.exists(), done.stderr[-3000:]
    return done.returncode, json.loads(out.read_text()), done.stdout


def assert_accounted(record: dict, sent: int) -> None:
    summary = record["summary"]
    assert summary["sent"] == sent == len(record["requests"])
    assert summary["completed"] + summary["errored"] == sent
    assert sum(summary["errors"].values()) == summary["errored"]
    for r in record["requests"]:
        if r["error_kind"] is None:
            assert r["model"] and r["ttft_s"] is not None and r["output_tokens"] >= 1
            assert r["reward"] == 0.0 or r["slo_met"]
        else:
            assert r["error"], r


def test_replay_over_http3_counts_refusals_as_errors(server: Server, tmp_path: Path) -> None:
    # No key: the anonymous tier cannot reach real-time, so those requests come back 403.
    rc, record, stdout = replay(
        tmp_path / "h3.json",
        "--proto", "h3", "--url", f"https://localhost:{server.h3_port}", "--cacert", str(CERT),
        "--classes", "free-tier=2,real-time=1",
    )  # fmt: skip
    assert_accounted(record, 12)
    real_time = sum(r["qos_class"] == "real-time" for r in record["requests"])
    assert 0 < real_time < 12
    assert record["summary"]["errors"] == {"http_403": real_time}
    assert record["summary"]["completed"] == 12 - real_time
    assert rc == 1
    assert "Successful requests:" in stdout and "free-tier" in stdout


def test_replay_over_http1_with_sessions_and_a_key(server: Server, tmp_path: Path) -> None:
    rc, record, _ = replay(
        tmp_path / "h1.json",
        "--proto", "h1", "--url", server.url, "--sessions", "--classes", "real-time",
        api_key=PREMIUM_KEY,
    )  # fmt: skip
    assert_accounted(record, 12)
    assert rc == 0, record["summary"]["errors"]
    assert record["summary"]["per_class"]["real-time"]["completed"] == 12
    assert (tmp_path / "h1.png").stat().st_size > 10_000
    # The server counts the prompt each turn really sent, and later turns send more.
    assert sum(r["prompt_tokens"] for r in record["requests"]) > 12 * 20


def test_replay_through_the_edge_frontend(frontend: Server, tmp_path: Path) -> None:
    rc, record, _ = replay(
        tmp_path / "edge.json",
        "--proto", "h3", "--url", f"https://localhost:{frontend.h3_port}", "--cacert", str(CERT),
    )  # fmt: skip
    assert_accounted(record, 12)
    assert rc == 0, record["summary"]["errors"]


def test_replay_names_an_unreachable_endpoint(tmp_path: Path) -> None:
    port = free_port()
    rc, record, _ = replay(
        tmp_path / "down.json", "--proto", "h1", "--url", f"http://127.0.0.1:{port}"
    )
    assert_accounted(record, 12)
    assert record["summary"]["errors"] == {"connection": 12}
    assert rc == 1


def test_replay_sends_exactly_the_requests_of_a_file(server: Server, tmp_path: Path) -> None:
    spec = WorkloadSpec(Poisson(6.0), default_shape=TaskShape(None, (4, 8)))
    wanted = list(requests(spec, 3, 2.0))
    wanted = [replace(r, qos_class=c) for r, c in zip(wanted, cycle(["free-tier", "long"]))]
    save_requests(tmp_path / "requests.jsonl", wanted)
    assert load_requests(tmp_path / "requests.jsonl") == wanted
    rc, record, _ = replay(
        tmp_path / "exact.json",
        "--proto", "h3", "--url", f"https://localhost:{server.h3_port}", "--cacert", str(CERT),
        "--requests", str(tmp_path / "requests.jsonl"), "--scheduler", "edf",
        "--congestion-control", "cubic",
    )  # fmt: skip
    assert rc == 0, record["summary"]["errors"]
    assert_accounted(record, len(wanted))
    sent = {r["request_id"]: r for r in record["requests"]}
    for w in wanted:
        assert sent[w.request_id]["qos_class"] == w.qos_class
        assert sent[w.request_id]["arrival_s"] == w.arrival
        assert sent[w.request_id]["output_tokens"] == w.max_tokens  # the load ignores EOS


def test_a_run_where_nothing_completed_still_gets_its_plot(tmp_path: Path) -> None:
    # Three requests, all refused: no latency to draw on the plot's log scale.
    port = free_port()
    out = tmp_path / "none.json"
    rc, record, _ = replay(out, "--proto", "h1", "--url", f"http://127.0.0.1:{port}",
                           "--num-requests", "3")  # fmt: skip
    assert rc == 1 and record["summary"]["errors"] == {"connection": 3}
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "/nonexistent.jsonl"], "/nonexistent.jsonl"),
        (["--proto", "h2", "--url", "http://localhost:8000"], "give an https:// --url"),
        (["--proto", "h3", "--connection-per-request"], "is for --proto h1"),
        (["--arrivals", "trace", "--trace", "/nonexistent.csv"], "cannot read"),
        (["--tasks", "gsm8k"], "no prompts for task"),
        (["--deployment", "nope"], "unknown deployment"),
        (["--output-tokens", "9:3"], "LO:HI"),
        (["--lengths", "conversations", "--sessions"], "lengths take the place"),
    ],
)
def test_bad_arguments_get_a_clear_message(args: list[str], message: str) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "workloads.replay", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_a_malformed_requests_file_is_named_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "requests.jsonl"
    save_requests(bad, list(requests(WorkloadSpec(Poisson(6.0)), 0, 1.0))[:2])
    bad.write_text(bad.read_text() + '{"arrival": 1}\n')
    done = subprocess.run(
        [PYTHON, "-m", "workloads.replay", "--requests", str(bad)], cwd=ROOT,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "line 3: not a request" in done.stderr and "Traceback" not in done.stderr


def test_the_replay_says_when_it_could_not_keep_up() -> None:
    from workloads.replay import client_health
    from workloads.summary import Outcome

    def outcomes(lag_s: float, wait_s: float) -> list[Outcome]:
        return [
            Outcome(f"r{i}", "free-tier", None, i * 0.1, lag_s=lag_s if i >= 98 else 0.001,
                    credit_wait_s=wait_s if i >= 98 else 0.0)
            for i in range(100)
        ]  # fmt: skip

    calm = client_health(outcomes(0.01, 0.0), duration_s=10, cpu_s=2)
    assert calm["kept_up"] and calm["warnings"] == [] and calm["cpu_share_of_core"] == 0.2
    late = client_health(outcomes(0.5, 0.0), duration_s=10, cpu_s=2)
    assert not late["kept_up"] and "sent late" in late["warnings"][0]
    busy = client_health(outcomes(0.01, 0.0), duration_s=10, cpu_s=9.5)
    assert not busy["kept_up"] and "of a core" in busy["warnings"][0]
    waited = client_health(outcomes(0.01, 0.2), duration_s=10, cpu_s=2)
    assert waited["credit_waited"] == 2 and "stream credit" in waited["warnings"][0]


@pytest.mark.parametrize("arrival", [-1.0, float("nan"), float("inf"), "soon"])
def test_a_request_that_cannot_be_scheduled_is_refused_with_its_line(
    tmp_path: Path, arrival: object
) -> None:
    path = tmp_path / "requests.jsonl"
    save_requests(path, list(requests(WorkloadSpec(Poisson(6.0)), 0, 1.0))[:1])
    row = json.loads(path.read_text())
    path.write_text(path.read_text() + json.dumps({**row, "arrival": arrival}) + "\n")
    with pytest.raises(ValueError, match="line 2: not a request .*arrival"):
        load_requests(path)


def test_without_a_deployment_the_replay_scores_with_the_one_the_server_serves(
    paper_twin: Server, tmp_path: Path
) -> None:
    # The twin serves the OPT models, not the default deployment's: scored against the default's
    # quality table, every answer was worth 0, and the run said reward 0.000.
    rc, record, stdout = replay(
        tmp_path / "twin.json", "--proto", "h1", "--url", paper_twin.url, "--classes", "long"
    )
    assert_accounted(record, 12)
    assert rc == 0, record["summary"]["errors"]
    assert record["deployment"] == "paper-4gpu"  # the first that serves them; the twin's table
    met = [r for r in record["requests"] if r["slo_met"]]
    assert met and all(r["reward"] > 0 for r in met)
    assert record["summary"]["mean_reward"] > 0
    assert "No reward" not in stdout


def test_a_length_distribution_is_replayed_with_each_answer_its_drawn_length(
    paper_twin: Server, tmp_path: Path
) -> None:
    from workloads.replay import build_workload, parser

    flags = ["--lengths", "short-chat", "--seed", "4"]
    rc, record, _ = replay(tmp_path / "lengths.json", "--proto", "h1", "--url", paper_twin.url,
                           "--classes", "long", *flags)  # fmt: skip
    assert_accounted(record, 12)
    assert rc == 0, record["summary"]["errors"]
    spec, _ = build_workload(parser().parse_args([*SHORT, "--classes", "long", *flags]), 2048)
    drawn = {r.request_id: r for r in requests(spec, 4, None, 12)}
    served = {r["request_id"]: r["output_tokens"] for r in record["requests"]}
    # short-chat sends no max_tokens: without --lengths the twin would end answers at random.
    assert all(drawn[i].max_tokens is None for i in served)
    assert served == {i: drawn[i].answer_tokens for i in served}


def test_the_replay_says_why_it_cannot_score_a_server_no_deployment_describes(
    null_server: Server, tmp_path: Path
) -> None:
    rc, record, stdout = replay(tmp_path / "null.json", "--proto", "h1", "--url", null_server.url,
                                "--model", "null")  # fmt: skip
    assert rc == 0 and record["summary"]["completed"] == 12
    assert record["deployment"] is None and record["summary"]["mean_reward"] is None
    assert "No reward: no deployment of" in stdout and "serves exactly the models null" in stdout
    assert "Mean reward:" in stdout and "Windows of" not in stdout
