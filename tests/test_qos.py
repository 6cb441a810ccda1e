"""QoS classification: key tier first, then x-qos-class, then the RFC 9218 priority header."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import load_deployment
from transport.qos import QosClassifier, QosRejected

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def classifier() -> QosClassifier:
    dep = load_deployment(ROOT / "models.yaml")
    return QosClassifier(dep.qos_classes, dep.tiers, {"gold": "premium"}, dep.anonymous_tier)


def cls(classifier: QosClassifier, **headers: str) -> str:
    return classifier.classify({k.replace("_", "-"): v for k, v in headers.items()}).qos_class


def test_each_tier_gets_its_default(classifier: QosClassifier) -> None:
    assert cls(classifier) == "free-tier"
    assert cls(classifier, authorization="Bearer gold") == "real-time"


def test_a_named_class_within_the_tier_is_granted(classifier: QosClassifier) -> None:
    assert cls(classifier, x_qos_class="long") == "long"
    assert cls(classifier, authorization="Bearer gold", x_qos_class="free-tier") == "free-tier"


def test_without_a_key_that_grants_it_real_time_is_refused(classifier: QosClassifier) -> None:
    for headers in ({}, {"authorization": "Bearer wrong"}):
        with pytest.raises(QosRejected) as err:
            classifier.classify({**headers, "x-qos-class": "real-time"})
        assert err.value.status == 403


def test_priority_header_maps_to_the_nearest_granted_class(classifier: QosClassifier) -> None:
    assert cls(classifier, authorization="Bearer gold", priority="u=0") == "real-time"
    assert cls(classifier, authorization="Bearer gold", priority="u=3, i") == "free-tier"
    # Halfway between free-tier (3) and long (5), the less urgent class wins.
    assert cls(classifier, authorization="Bearer gold", priority="u=4") == "long"
    assert cls(classifier, authorization="Bearer gold", priority="i, u=6") == "long"
    # An anonymous client asking for the most urgent level still cannot reach real-time.
    assert cls(classifier, priority="u=0") == "free-tier"
    # Unparseable priorities are ignored, as RFC 9218 asks.
    assert cls(classifier, priority="u=high") == "free-tier"


def test_the_class_header_outranks_the_priority_header(classifier: QosClassifier) -> None:
    assert cls(classifier, x_qos_class="long", priority="u=0") == "long"


def test_unknown_class_is_a_400(classifier: QosClassifier) -> None:
    with pytest.raises(QosRejected) as err:
        classifier.classify({"x-qos-class": "platinum"})
    assert err.value.status == 400


def test_keys_required_when_there_is_no_anonymous_tier() -> None:
    dep = load_deployment(ROOT / "models.yaml")
    strict = QosClassifier(dep.qos_classes, dep.tiers, {"gold": "premium"}, None)
    with pytest.raises(QosRejected) as err:
        strict.classify({})
    assert err.value.status == 401
    assert strict.classify({"authorization": "Bearer gold"}).tier == "premium"


@pytest.fixture
def edge_aware() -> QosClassifier:
    dep = load_deployment(ROOT / "models.yaml")
    keys = {"gold": "premium", "edge-secret": "edge"}
    return QosClassifier(dep.qos_classes, dep.tiers, keys, dep.anonymous_tier)


def test_a_tag_carries_the_arrival_class_and_deadline(edge_aware: QosClassifier) -> None:
    tag = edge_aware.tag({"authorization": "Bearer gold"}, now=100.0)
    assert (tag.arrival, tag.qos_class, tag.tier, tag.via_edge) == (
        100.0,
        "real-time",
        "premium",
        False,
    )
    assert tag.spec.deadline == 101.0 and tag.spec.high and tag.rejected is None
    refused = edge_aware.tag({"x-qos-class": "real-time"}, now=100.0)
    assert refused.qos_class is None and refused.rejected is not None
    assert refused.rejected.status == 403 and refused.spec.deadline is None


def test_only_an_edge_key_makes_forwarded_headers_count(edge_aware: QosClassifier) -> None:
    sent = edge_aware.tag({"authorization": "Bearer gold"}, now=100.0)
    forwarded = sent.forwarded(now=100.25, edge_key="edge-secret")
    kept = edge_aware.tag(forwarded, now=100.5)
    assert kept.via_edge and kept.arrival == pytest.approx(100.25)
    assert (kept.qos_class, kept.tier, kept.request_id) == ("real-time", "premium", sent.request_id)
    assert kept.spec.deadline == pytest.approx(101.25)
    for key in ("guess", "gold", ""):  # a wrong key, or a key of a tier that is not an edge
        forged = edge_aware.tag({**forwarded, "x-edge-key": key}, now=100.5)
        assert not forged.via_edge and forged.arrival == 100.5
        assert forged.qos_class == "free-tier" and forged.request_id != sent.request_id


def test_an_unreadable_edge_age_counts_as_none(edge_aware: QosClassifier) -> None:
    for age in ("soon", "nan", "-5", "inf"):
        tag = edge_aware.tag({"x-edge-key": "edge-secret", "x-edge-age": age}, now=100.0)
        assert tag.via_edge and tag.arrival == 100.0 and tag.qos_class == "free-tier"
    capped = edge_aware.tag({"x-edge-key": "edge-secret", "x-edge-age": "1e9"}, now=1e4)
    assert capped.arrival == 1e4 - 3600


def test_a_client_may_name_its_request(edge_aware: QosClassifier) -> None:
    assert edge_aware.tag({"x-request-id": "bench-1a2b-17"}, now=0.0).request_id == "bench-1a2b-17"
    for unfit in ("", "has space", "x" * 129, "semi;colon"):
        assert edge_aware.tag({"x-request-id": unfit}, now=0.0).request_id != unfit
