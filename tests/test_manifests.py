"""deploy/kubernetes: every manifest against Kubernetes' published schemas (kubernetes-validate,
at 1.26, the first with UDP and TCP on one LoadBalancer, and at the newest it knows), every
container's arguments through the project's own parsers, and the ties between the manifests
that no schema sees: the DNS name the placement gives is the headless Service's, its hosts are
the engine pods, the grace periods outlast the drains."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from config import load_deployment
from router.policies import make_policy
from serving.__main__ import build_parser
from serving.engine_host import parse_args
from serving.launch import ROOT

FOLDER = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.26.0", kubernetes_validate.latest_version())


def documents() -> list[dict[str, Any]]:
    found = []
    for path in sorted(FOLDER.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(deployment: str) -> dict[str, Any]:
    (only,) = one("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return only


def argv(spec: dict[str, Any]) -> list[str]:
    """A container's arguments, with `$(VAR)` replaced as the kubelet does, from its env."""
    config = one("ConfigMap", "qos-llm")["data"]
    env = {}
    for var in spec.get("env", []):
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        env[var["name"]] = config[ref["key"]] if ref else var["value"]
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg) for arg in spec["args"]]


def option(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def test_every_manifest_validates_against_kubernetes_schemas() -> None:
    listed = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in FOLDER.glob("*.yaml")
                                    if p.name != "kustomization.yaml")  # fmt: skip
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Namespace", "Secret", "ConfigMap", "Service",
                                         "Deployment"}  # fmt: skip
    for doc in docs:
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_manifest_that_breaks_the_schema_is_caught() -> None:
    broken = one("Deployment", "front-end")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def test_every_containers_arguments_parse_with_the_projects_parsers() -> None:
    front = container("front-end")
    assert front["command"] == ["python", "-m", "serving"]
    build_parser().parse_args(argv(front))
    engines = container("engines")
    assert engines["command"] == ["python", "-m", "serving.engine_host"]
    parse_args(argv(engines))
    with pytest.raises(SystemExit):  # the parsers do refuse: an engine host with no token
        parse_args([a for a in argv(engines) if not a.startswith("--link-token-file")])


def test_the_placement_names_the_headless_service_and_its_pods(tmp_path: Path) -> None:
    """The config map's models.yaml, on top of the shipped one, as the pods read it: its engine
    host name is the Service `engines` in the namespace, at its port, with a slot per pod, and
    the shipped DQN routes it (the same 12 replicas, in the order it was trained on)."""
    overlay = yaml.safe_load(one("ConfigMap", "qos-llm")["data"]["models.yaml"])
    assert overlay["extends"] == "/app/models.yaml"  # the image's WORKDIR is /app
    overlay["extends"] = str(ROOT / "models.yaml")
    config = tmp_path / "models.yaml"
    config.write_text(yaml.safe_dump(overlay))
    service = one("Service", "engines")
    assert service["spec"]["clusterIP"] == "None"
    pods = one("Deployment", "engines")["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == pods
    port = service["spec"]["ports"][0]["port"]
    name = f"engines.{service['metadata']['namespace']}.svc.cluster.local:{port}"
    engine_args = argv(container("engines"))
    assert option(engine_args, "as") == name
    assert option(engine_args, "listen").endswith(f":{port}")
    for deployment_name in (one("ConfigMap", "qos-llm")["data"]["deployment"],
                            "paper-4gpu-fleet-sim"):  # fmt: skip
        deployment = load_deployment(config, deployment_name)
        assert deployment.discovered == {name: one("Deployment", "engines")["spec"]["replicas"]}
        shipped = load_deployment(ROOT / "models.yaml", "paper-4gpu")
        assert [r.model for r in deployment.replicas] == [r.model for r in shipped.replicas]
        make_policy(deployment)  # the shipped DQN fits its view
        assert deployment.run_by(name).replicas  # what each engine pod runs


def test_the_front_ends_count_each_other_through_their_headless_service() -> None:
    service = one("Service", "front-ends")
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"]
        == one("Deployment", "front-end")["spec"]["selector"]["matchLabels"]
    )
    name = f"front-ends.{service['metadata']['namespace']}.svc.cluster.local"
    assert option(argv(container("front-end")), "front-ends") == name


def test_the_grace_periods_outlast_the_drains() -> None:
    for name in ("front-end", "engines"):
        pod = one("Deployment", name)["spec"]["template"]["spec"]
        (spec,) = pod["containers"]
        pre_stop = float(spec["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = float(option(argv(spec), "drain-s"))
        assert pod["terminationGracePeriodSeconds"] > pre_stop + drain, name


def test_the_load_balancer_carries_quic_and_tcp_to_the_ports_served() -> None:
    service = one("Service", "front-end")
    assert service["spec"]["type"] == "LoadBalancer"
    ports = {p["protocol"]: p for p in service["spec"]["ports"]}
    args = argv(container("front-end"))
    named = {p["name"]: p["containerPort"] for p in container("front-end")["ports"]}
    assert named[ports["UDP"]["targetPort"]] == int(option(args, "h3-port"))
    assert named[ports["TCP"]["targetPort"]] == int(option(args, "port"))
    # HTTP/1.1 answers' Alt-Svc names the pod's HTTP/3 port: the outside port must be it.
    assert ports["UDP"]["port"] == int(option(args, "h3-port"))


def test_the_secrets_placeholders_are_refused(tmp_path: Path) -> None:
    from serving.engines.engine_link import read_link_token
    from transport.stateless_reset import ResetKey

    secret = one("Secret", "qos-llm")["stringData"]
    for key, path in (("link-token", "link-token-file"), ("reset-key", "reset-key-file")):
        mounted = option(argv(container("front-end")), path)
        assert mounted.endswith(f"/{key}")
        (tmp_path / key).write_text(secret[key])
    with pytest.raises(ValueError, match="placeholder"):
        read_link_token(str(tmp_path / "link-token"))
    with pytest.raises(ValueError, match="placeholder"):
        ResetKey.from_file(tmp_path / "reset-key")
