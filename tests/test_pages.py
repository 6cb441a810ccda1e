"""The playground (`/`) and the dashboard (`/dashboard`): in a real browser over HTTP/3, over
HTTP/1.1, and who may see the dashboard.

The browser is Debian's headless Chromium, driven by Playwright, with the flags that make it
speak QUIC to the embedded server under its self-signed certificate (docs/operations.md,
"The playground and the dashboard"). Where it truly came over HTTP/3 is checked on the server's
side: the request log line of the page's chat request names protocol "3".
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.servers import CERT, PREMIUM_KEY, ROOT, Server
from tests.support.tiers import starts

SCREENSHOTS = ROOT / "results" / "pages"
CHROMIUM = "/usr/bin/chromium"
ADMIN_KEY = "test-admin-key"
STREAMED_TOKENS = 96
"""Enough tokens that even the fastest model's answer takes many reads to arrive."""


def _spki_hash(cert: Path) -> str:
    """base64(sha256(SubjectPublicKeyInfo)): what --ignore-certificate-errors-spki-list takes."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = x509.load_pem_x509_certificate(cert.read_bytes()).public_key()
    der = public.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(hashlib.sha256(der).digest()).decode()


def chromium_args(h3_port: int) -> list[str]:
    """Chromium's flags for HTTP/3 to localhost:`h3_port` under the server's own certificate."""
    return [
        "--enable-quic",
        # No TCP to fall back on: the origin is QUIC only, so a page that loads came over it.
        f"--origin-to-force-quic-on=localhost:{h3_port}",
        # localhost would resolve to ::1 first, where the server does not listen.
        "--host-resolver-rules=MAP localhost 127.0.0.1",
        f"--ignore-certificate-errors-spki-list={_spki_hash(CERT)}",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]


@pytest.fixture
@starts("browser")
def browser(server: Server) -> Iterator[Any]:
    """Headless Chromium, ready for the embedded server's HTTP/3 port. Per test: Playwright's
    sync API runs an event loop of its own in this thread while it lives, and the asyncio
    tests of the session could not run theirs beside it."""
    if not Path(CHROMIUM).exists():
        # CI sets REQUIRE_BROWSER (.ci/run): there, a browser test that did not run is a failure.
        missing = "no /usr/bin/chromium (scripts/setup.sh installs it with apt)"
        if os.environ.get("REQUIRE_BROWSER"):
            pytest.fail(missing)
        pytest.skip(missing)
    sync_api = pytest.importorskip("playwright.sync_api")
    assert server.h3_port is not None
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, args=chromium_args(server.h3_port)
        )
        yield launched
        launched.close()


def _answer_state(page: Any) -> dict[str, Any]:
    return page.evaluate(
        """() => {
            const a = document.querySelector('#transcript .answer');
            if (!a) return {length: 0, done: false};
            return {length: a.querySelector('.text').textContent.length,
                    done: a.dataset.done === '1', requestId: a.dataset.requestId || null};
        }"""
    )


def _facts(page: Any) -> dict[str, str]:
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('#transcript dd[data-fact]')]
            .map(dd => [dd.dataset.fact, dd.textContent]))"""
    )


def test_the_playground_streams_a_chat_over_http3_and_the_dashboard_shows_it(
    server: Server, browser: Any
) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    origin = f"https://localhost:{server.h3_port}"
    page = browser.new_page(viewport={"width": 1100, "height": 760})
    page.set_default_timeout(60_000)
    try:
        loaded = page.goto(origin + "/")
        assert loaded is not None and loaded.ok
        # The browser's own word for the page; the server's for the chat, below.
        assert page.evaluate(
            "performance.getEntriesByType('navigation')[0].nextHopProtocol"
        ).startswith("h3")
        # Predicates as functions: the pages' Content-Security-Policy forbids eval, which
        # Playwright would use for an expression given as a string.
        page.wait_for_function("() => document.querySelector('#model').options.length > 1")
        page.wait_for_function("() => document.querySelector('#qos-class').options.length > 1")
        # A real-time request: the class a key must grant, with the key in the page's field.
        page.select_option("#qos-class", "real-time")
        page.fill("#api-key", PREMIUM_KEY)
        page.fill("#max-tokens", str(STREAMED_TOKENS))
        page.fill("#message", "Hello from a browser over QUIC!")
        # Every text the page gives the answer, recorded in the page as it is given: a poll from
        # here would see fewer steps the busier the machine (CI's Playwright round trips once
        # saw a 96-token answer only whole). Setting textContent replaces the element's text
        # node; the record keeps the node it added, and the node keeps the text set.
        page.evaluate(
            """() => {
                window.answerTexts = [];
                new MutationObserver(records => {
                    for (const r of records) {
                        if (!r.target.classList?.contains('text') || !r.target.closest('.answer'))
                            continue;
                        for (const n of r.addedNodes) window.answerTexts.push(n.data);
                    }
                }).observe(document.querySelector('#transcript'), {childList: true, subtree: true});
            }"""
        )
        page.click("#send")
        page.wait_for_function(
            "() => document.querySelector('#transcript .answer')?.dataset.done === '1'",
            timeout=120_000,  # a hang fails here; no timing decides a pass
        )
        state = _answer_state(page)
        facts = _facts(page)
        errors = page.locator("#transcript .error")
        assert errors.count() == 0, errors.all_inner_texts()
        # The answer is shown as it streams: a text per content event, each the one before it
        # and more. A page that waited for the whole body would give it one text. (One text per
        # event, so how the browser's reads grouped the events does not matter here.)
        texts: list[str] = page.evaluate("() => window.answerTexts")
        assert len(texts) >= 2, f"the answer was shown in {len(texts)} step(s): {texts}"
        assert all(b.startswith(a) and len(b) > len(a) for a, b in pairwise(texts)), texts
        assert len(texts[-1]) == state["length"] > 0

        # The server's side: the page's request came over HTTP/3, as the class the key grants.
        request_id = state["requestId"]
        line = server.logged(request_id)
        assert line["protocol"] == "3"
        assert line["outcome"] == "ok" and line["tokens"] == STREAMED_TOKENS
        assert line["qos_class"] == "real-time" and line["tier"] == "premium"
        # The page says who served it, and how, as the server logged it.
        assert facts["model"] == line["model"] and facts["replica"] == line["replica"]
        assert facts["class"] == "real-time" and facts["tokens"] == str(STREAMED_TOKENS)
        assert facts["protocol"] == "HTTP/3", facts
        assert facts["TTFT"].endswith(" ms") and facts["gaps"].startswith("mean ")
        page.screenshot(path=str(SCREENSHOTS / "playground.png"))

        # The dashboard, over the same QUIC origin, lists the request and the decision.
        shown = page.goto(origin + "/dashboard")
        assert shown is not None and shown.ok
        has_id = """([table, id]) => [...document.querySelectorAll(`#${table} td`)]
            .some(td => td.textContent === id)"""
        page.wait_for_function(has_id, arg=["ended", request_id])
        page.wait_for_function(has_id, arg=["decisions", request_id])
        row = page.evaluate(
            """id => [...document.querySelectorAll('#ended tr')]
                .map(tr => [...tr.children].map(td => td.textContent))
                .find(cells => cells.includes(id))""",
            request_id,
        )
        assert "HTTP/3" in row and "ok" in row and line["model"] in row
        replicas = page.evaluate(
            "[...document.querySelectorAll('#replicas tr')].map(tr => tr.children[0].textContent)"
        )
        assert len(replicas) == 3 and line["replica"] in replicas
        assert "HTTP/3" in page.inner_text("#status")
        # Two snapshots make the feed's share of the CPU: wait for it, for the screenshot.
        page.wait_for_function(
            "() => document.querySelector('#feed-share').textContent.endsWith('%')"
        )
        page.screenshot(path=str(SCREENSHOTS / "dashboard.png"), full_page=True)
    finally:
        page.close()


def test_the_pages_come_over_http11_too(server: Server) -> None:
    page = httpx.get(server.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    # Nothing from elsewhere: the policy allows this origin only, and the page names no other.
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text
    assert page.headers["alt-svc"].startswith("h3=")  # where a browser finds HTTP/3
    script = httpx.get(server.url + "/static/playground.js", timeout=10)
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert httpx.get(server.url + "/static/nothing.js", timeout=10).status_code == 404
    state = httpx.get(server.url + "/dashboard/state", timeout=10)
    assert state.status_code == 200, state.text
    assert [r["model"] for r in state.json()["replicas"]] == ["tiny-s", "tiny-m", "tiny-l"]
    # The feed: an event stream whose first snapshot comes at once.
    with httpx.stream("GET", server.url + "/dashboard/events", timeout=10) as feed:
        assert feed.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in feed.iter_lines() if line.startswith("data: "))
    snapshot = json.loads(first.removeprefix("data: "))
    assert {"real-time", "free-tier", "long"} <= {c["name"] for c in snapshot["classes"]}
    assert snapshot["feed"]["snapshots"] >= 1


@pytest.fixture(scope="module")
def in_process_app() -> Any:
    """The twin's whole app in this process (not started: no request here reaches an engine),
    with a premium and an admin key."""
    from config import load_deployment
    from serving.app import build_app

    twin = load_deployment(name="embedded-sim")
    return build_app(replace(twin, api_keys={PREMIUM_KEY: "premium", ADMIN_KEY: "admin"}))


async def _get(app: Any, client: str, path: str, **headers: str) -> httpx.Response:
    transport = httpx.ASGITransport(app=app, client=(client, 50000))
    async with httpx.AsyncClient(transport=transport, base_url="https://server") as http:
        return await http.get(path, headers=headers)


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/state", "/dashboard/events"])
async def test_only_loopback_or_an_admin_key_sees_the_dashboard(
    in_process_app: Any, path: str
) -> None:
    stranger = await _get(in_process_app, "203.0.113.7", path)
    assert stranger.status_code == 403
    error = stranger.json()["error"]
    assert error["code"] == "dashboard_forbidden"
    assert "loopback" in error["message"] and "203.0.113.7" in error["message"]
    # A key of another tier is no admin's.
    premium = await _get(in_process_app, "203.0.113.7", path, authorization=f"Bearer {PREMIUM_KEY}")
    assert premium.status_code == 403
    # A local proxy (an edge) would make every client of its look local.
    proxied = await _get(in_process_app, "127.0.0.1", path, **{"x-forwarded-for": "203.0.113.7"})
    assert proxied.status_code == 403 and "proxy" in proxied.json()["error"]["message"]
    if path == "/dashboard/events":
        return  # an endless stream: its admission is the same check as the others'
    for client, headers in [
        ("203.0.113.7", {"authorization": f"Bearer {ADMIN_KEY}"}),
        ("127.0.0.1", {}),
        ("::1", {}),
    ]:
        allowed = await _get(in_process_app, client, path, **headers)
        assert allowed.status_code == 200, (client, allowed.text)


async def test_the_playground_is_for_everyone(in_process_app: Any) -> None:
    # No key, from afar, with a class header its tier does not grant: a page is no request
    # for generation, so the QoS tagging refuses nothing here.
    page = await _get(in_process_app, "203.0.113.7", "/", **{"x-qos-class": "real-time"})
    assert page.status_code == 200 and "playground.js" in page.text
    offered = (await _get(in_process_app, "203.0.113.7", "/playground/options")).json()
    by_name = {c["name"]: c for c in offered["classes"]}
    assert by_name["real-time"]["needs_key"] and not by_name["free-tier"]["needs_key"]
    assert offered["default_class"] == "free-tier" and offered["models"][0] == "auto"


def test_the_feed_interval_is_bounded_whatever_is_asked() -> None:
    from serving.pages import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, MIN_INTERVAL_S, _interval

    assert _interval(None) == DEFAULT_INTERVAL_S and _interval("2.5") == 2.5
    assert _interval("0") == MIN_INTERVAL_S and _interval("1e9") == MAX_INTERVAL_S
    for junk in ("nan", "inf", "soon", ""):
        assert _interval(junk) == DEFAULT_INTERVAL_S


def test_the_page_files_ship_in_the_package() -> None:
    shipped = {f.name for f in (resources.files("serving") / "static").iterdir()}
    assert {"playground.html", "dashboard.html", "pages.css"} <= shipped
    assert {"playground.js", "dashboard.js"} <= shipped
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"static/*.html", "static/*.css", "static/*.js"' in pyproject


def test_the_recorder_keeps_a_sliding_minute_per_class() -> None:
    from serving.outcomes import CLIENTS_OWN, OK, REFUSED, SHED, RequestRecord
    from serving.recent import Recent

    now = [1000.0]
    recent = Recent(CLIENTS_OWN, SHED, keep=4, window_s=60, clock=lambda: now[0])

    def end(outcome: str, met: bool, qos_class: str | None = "free-tier") -> None:
        recent.finished(RequestRecord("r", qos_class, now[0]), outcome, met)

    end(OK, True)
    end(OK, False)
    end(SHED, False)
    end(REFUSED, False)  # the client's own doing: neither for nor against
    end(REFUSED, False, qos_class=None)  # no class at all: no class's minute
    minute = recent.window()["free-tier"]
    assert (minute.ended, minute.counted, minute.slo_met, minute.shed) == (4, 3, 1, 1)
    assert minute.attainment == pytest.approx(1 / 3) and minute.shed_rate == pytest.approx(1 / 3)
    assert len(recent.ended) == 4  # bounded: the oldest went
    now[0] += 59
    end(OK, True)
    assert recent.window()["free-tier"].counted == 4
    now[0] += 1  # the first second has left the window
    assert recent.window()["free-tier"].counted == 1
    now[0] += 3600  # a slot that comes round again starts from nothing
    end(OK, True)
    assert recent.window()["free-tier"].counted == 1
