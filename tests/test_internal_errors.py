"""A fault of the server's own is still an answer and still counted: a 500 that says so, one
`internal` outcome in `serving_requests_total` and the request log, and nothing held after it.
The twin's whole app in this process, with a bug planted in the handler and in the router."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from config import load_deployment
from serving import app as app_module
from serving.app import build_app
from serving.protocol import GenerateRequest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def outcomes(metrics: str) -> dict[str, float]:
    counted: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "serving_requests_total" and sample.value:
                outcome = sample.labels["outcome"]
                counted[outcome] = counted.get(outcome, 0) + sample.value
    return counted


class Broken:
    """A policy with a bug."""

    def choose(self, obs: Any, request: Any, view: Any) -> int:
        raise ZeroDivisionError("a bug")


def bad_sampling(self: GenerateRequest) -> Any:
    raise ZeroDivisionError("a bug")


@pytest.mark.parametrize("where", ["handler", "router"])
async def test_a_fault_of_the_servers_own_is_a_500_counted_as_internal(
    where: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "handler":
        monkeypatch.setattr(GenerateRequest, "sampling", bad_sampling)
    else:
        monkeypatch.setattr(app_module, "make_policy", lambda deployment, policy: Broken())
    caplog.set_level(logging.INFO, logger="serving.requests")
    app = build_app(load_deployment(name="embedded-sim").with_time_scale(0.01))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://twin") as http,
    ):
        for stream in (False, True):
            response = await http.post("/v1/chat/completions", json=CHAT | {"stream": stream})
            assert response.status_code == 500, response.text
            assert response.json()["error"]["code"] == "internal_error"
        metrics = (await http.get("/metrics")).text
        ready = (await http.get("/readyz")).json()
    assert outcomes(metrics) == {"internal": 2}
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "serving.requests"]
    assert [line["outcome"] for line in logged] == ["internal", "internal"]
    assert "serving_replica_in_flight" in metrics
    for family in text_string_to_metric_families(metrics):
        if family.name == "serving_replica_in_flight":
            assert all(sample.value == 0 for sample in family.samples), family
    assert ready is not None
