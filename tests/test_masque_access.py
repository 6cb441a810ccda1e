"""Who may open MASQUE tunnels, to where, at which priority: `TunnelAccess` from models.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from config import ConfigError, load_deployment
from transport.masque.access import TunnelAccess, TunnelGrant
from transport.masque.connect_udp import UdpTarget
from transport.qos import QosRejected

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def access(monkeypatch: pytest.MonkeyPatch) -> TunnelAccess:
    for name, value in [
        ("QOS_TUNNEL_KEY", "tunnel-s3cret"),
        ("QOS_PREMIUM_KEY", "premium-s3cret"),
        ("QOS_EDGE_KEY", "edge-s3cret"),
    ]:
        monkeypatch.setenv(name, value)
    return TunnelAccess.from_deployment(load_deployment(ROOT / "models.yaml", "embedded"))


def _grant(
    access: TunnelAccess, key: str | None, now: float = 100.0, **headers: str
) -> TunnelGrant:
    named = {name.replace("_", "-"): value for name, value in headers.items()}
    if key is not None:
        named["authorization"] = f"Bearer {key}"
    return access.grant(named, now)


def test_a_tunnel_tier_reaches_only_its_listed_targets(access: TunnelAccess) -> None:
    allow = _grant(access, "tunnel-s3cret").allow
    assert allow.allows(UdpTarget("127.0.0.1", 8443))
    assert allow.allows(UdpTarget("localhost", 8443))
    assert not allow.allows(UdpTarget("127.0.0.1", 8444))
    assert not allow.allows(UdpTarget("10.0.0.1", 8443))


def test_a_tier_without_tunnels_gets_an_empty_allow_list(access: TunnelAccess) -> None:
    # The proxy answers 403 for every target: a valid key, but no tunnel rights.
    assert not _grant(access, "premium-s3cret").allow.entries


@pytest.mark.parametrize("authorization", [None, "Bearer nope", "Basic tunnel-s3cret", "Bearer "])
def test_no_known_bearer_key_is_401(access: TunnelAccess, authorization: str | None) -> None:
    headers = {} if authorization is None else {"authorization": authorization}
    with pytest.raises(QosRejected) as denied:
        access.grant(headers, 0.0)
    assert denied.value.status == 401


def test_the_priority_header_sets_the_tunnels_priority(access: TunnelAccess) -> None:
    assert _grant(access, "tunnel-s3cret", priority="u=1").spec.priority == 6
    assert _grant(access, "tunnel-s3cret", priority="u=7, i").spec.priority == 0
    # Unreadable: ignored (RFC 9218), so the owner's class decides: free-tier, urgency 3.
    assert _grant(access, "tunnel-s3cret", priority="u=9").spec.priority == 4


def test_without_a_priority_header_the_owners_class_decides(access: TunnelAccess) -> None:
    default = _grant(access, "tunnel-s3cret", now=10.0).spec  # the tier's default: free-tier
    assert (default.priority, default.high, default.soft) == (4, False, True)
    assert default.deadline == pytest.approx(12.0)  # free-tier's 2 s, from the tunnel's start
    real_time = _grant(access, "tunnel-s3cret", x_qos_class="real-time").spec
    assert (real_time.priority, real_time.high) == (7, True)


def test_a_class_the_tier_does_not_grant_is_refused(access: TunnelAccess) -> None:
    with pytest.raises(QosRejected) as denied:
        _grant(access, "edge-s3cret", x_qos_class="real-time")  # edge grants free-tier only
    assert denied.value.status == 403
    with pytest.raises(QosRejected) as denied:
        _grant(access, "tunnel-s3cret", x_qos_class="no-such-class")
    assert denied.value.status == 400


@pytest.mark.parametrize("target", ["*:53", "*.example.org:53", "example.org", "[::1:53"])
def test_models_yaml_refuses_an_open_relay_or_a_malformed_target(
    tmp_path: Path, target: str
) -> None:
    spec = yaml.safe_load((ROOT / "models.yaml").read_text())
    spec["tiers"]["tunnel"]["tunnels"] = [target]
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="tunnels"):
        load_deployment(path, "embedded")
