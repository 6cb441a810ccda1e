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
