"""models.yaml: the shipped file loads, and a wrong file is refused with the field named."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

import config.deployment
from config import ConfigError, deployment_serving, load, load_deployment, resolve
from config.deployment import RENAMED_DEPLOYMENTS
from tests.support.servers import write_test_config

ROOT = Path(__file__).resolve().parent.parent


def shipped() -> dict:
    return yaml.safe_load((ROOT / "models.yaml").read_text())


def test_every_shipped_deployment_resolves() -> None:
    spec = load(ROOT / "models.yaml")
    sizes = {name: len(resolve(spec, name, ROOT).replicas) for name in spec.deployments}
    assert sizes == {
        "embedded": 3, "opt-cpu": 3, "paper-4gpu": 12, "remote": 3,
        "paper-4gpu-sim": 12, "embedded-sim": 3, "kubeai-l4-sim": 8,
    }  # fmt: skip


def test_paper_deployment_puts_one_of_each_model_on_each_gpu() -> None:
    dep = load_deployment(ROOT / "models.yaml", "paper-4gpu")
    for gpu in range(4):
        on_gpu = sorted(r.model for r in dep.replicas if r.device == f"cuda:{gpu}")
        assert on_gpu == ["opt-1.3b", "opt-125m", "opt-6.7b"]
    assert dep.profile is not None and dep.profile.source == "derived"


def test_quality_is_seed_table_1_normalised_to_the_deployments_best_model(tmp_path: Path) -> None:
    paper = load_deployment(ROOT / "models.yaml", "paper-4gpu").quality
    assert paper["hellaswag"] == {"opt-125m": 0.45, "opt-1.3b": 0.78, "opt-6.7b": 1.0}
    # Without a measured table, the tiny models take the rows of the OPT sizes they stand in for.
    spec = broken(lambda s: s["deployments"]["embedded"].pop("quality_file"))
    embedded = resolve(load(write(tmp_path, spec)), "embedded", ROOT).quality
    assert embedded["copa"] == {"tiny-s": 0.80, "tiny-m": 0.95, "tiny-l": 1.0}
    # Without OPT-6.7B, OPT-1.3B is the best model and scores 1.
    cpu = load_deployment(ROOT / "models.yaml", "opt-cpu").quality
    assert cpu["hellaswag"]["opt-1.3b"] == 1.0
    assert cpu["hellaswag"]["opt-125m"] == pytest.approx(0.45 / 0.78)


def test_kv_capacity_is_what_vllm_sizes() -> None:
    """On CPU the placement's kv_cache_gib, as vLLM logged it for the embedded engines ("CPU KV
    cache size: 131,072 tokens" for tiny-s, 21,760 for tiny-m); on a GPU the placement's share
    of the device less weights and reserve, in whole blocks."""
    embedded = {r.model: r for r in load_deployment(ROOT / "models.yaml", "embedded").replicas}
    assert (embedded["tiny-s"].kv_tokens, embedded["tiny-m"].kv_tokens) == (131_072, 21_760)
    assert embedded["tiny-s"].block_size == 128
    l4 = load_deployment(ROOT / "models.yaml", "kubeai-l4-sim").replicas[0]
    reserved = shipped()["profiles"]["l4-llama-3.1-8b-fp8"]["reserved_gib"]
    room = 0.95 * 22.49 * 2**30 - 8.03e9 * 1.13 - reserved * 2**30
    assert l4.block_size == 16
    assert l4.kv_tokens == int(room // (2 * 32 * 8 * 128)) // 16 * 16
    # Nothing sizes it: no cache modelled.
    assert all(
        r.kv_tokens is None for r in load_deployment(ROOT / "models.yaml", "remote").replicas
    )


def test_a_device_share_too_small_for_the_weights_is_refused(tmp_path: Path) -> None:
    spec = shipped()
    for entry in spec["placements"]["kubeai-8xl4"]:
        entry["memory_fraction"] = 0.3
    with pytest.raises(ConfigError, match="holds no KV cache beside"):
        load_deployment(write(tmp_path, spec), "kubeai-l4-sim")


def test_a_renamed_deployment_still_resolves_under_its_old_name(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For one release the old name of kubeai-l4-sim gives that deployment, under its new name,
    and the first use in a process warns that the old name is going."""
    (old,) = [name for name, new in RENAMED_DEPLOYMENTS.items() if new == "kubeai-l4-sim"]
    assert old not in shipped()["deployments"]
    monkeypatch.setattr(config.deployment, "_warned_renamed", set())
    current = load_deployment(ROOT / "models.yaml", "kubeai-l4-sim")
    with caplog.at_level(logging.WARNING, logger="config.deployment"):
        by_old_name = load_deployment(ROOT / "models.yaml", old)
        again = resolve(load(ROOT / "models.yaml"), old, ROOT)
    assert by_old_name == current and again == current
    assert by_old_name.name == "kubeai-l4-sim"
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and old in warned[0] and "deprecated" in warned[0]
    # A file that still defines the old name gets its own deployment, without a warning.
    spec = shipped()
    spec["deployments"][old] = spec["deployments"].pop("kubeai-l4-sim")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="config.deployment"):
        assert load_deployment(write(tmp_path, spec), old).name == old
    assert not caplog.records


def test_slo_is_40_ms_per_output_token() -> None:
    assert load(ROOT / "models.yaml").slo.tpot_s == 0.040


def write(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def broken(change) -> dict:
    spec = shipped()
    change(spec)
    return spec


BROKEN = {
    "typo in a key": (lambda s: s["slo"].update(tpot_ms=40), "slo.tpot_ms"),
    "negative SLO": (lambda s: s["slo"].update(tpot_s=-1), "slo.tpot_s"),
    "missing section": (lambda s: s.pop("qos_classes"), "qos_classes"),
    "head_dim the CPU kernel lacks": (
        lambda s: s["models"]["tiny-s"]["build"].update(hidden_size=96, num_heads=6),
        "models.tiny-s.build",
    ),
    "unknown placement": (
        lambda s: s["deployments"]["embedded"].update(placement="nowhere"),
        "deployments.embedded.placement",
    ),
    "unknown model in a placement": (
        lambda s: s["placements"]["embedded-cpu"][0].update(model="gpt-9"),
        "placements.embedded-cpu[0].model",
    ),
    "no location": (
        lambda s: s["placements"]["embedded-cpu"][0].pop("device"),
        "placements.embedded-cpu.0",
    ),
    "bad device": (
        lambda s: s["placements"]["embedded-cpu"][0].update(device="tpu"),
        "placements.embedded-cpu.0",
    ),
    "engine host not HOST:PORT": (
        lambda s: s["placements"]["embedded-cpu"][0].update(engine_host="node-2"),
        "placements.embedded-cpu.0.engine_host",
    ),
    "engine host for a url": (
        lambda s: s["placements"]["remote"][0].update(engine_host="node-2:7000"),
        "placements.remote.0",
    ),
    "hosts without an engine host": (
        lambda s: s["placements"]["embedded-cpu"][0].update(hosts=2),
        "placements.embedded-cpu.0",
    ),
    "cpu_cores not a core list": (
        lambda s: s["placements"]["embedded-cpu"][1].update(cpu_cores="the first two"),
        "placements.embedded-cpu.1.cpu_cores",
    ),
    "GPU over-committed": (
        lambda s: s["placements"]["paper-4gpu"][2].update(memory_fraction=0.9),
        "memory fractions on cuda:0",
    ),
    "tier granting an unknown class": (
        lambda s: s["tiers"]["premium"]["classes"].append("platinum"),
        "tiers.premium.classes",
    ),
    "tier default not granted": (
        lambda s: s["tiers"]["anonymous"].update(default="real-time"),
        "tiers.anonymous",
    ),
    "quality row for an unknown model": (
        lambda s: s["quality"]["tasks"]["copa"].update({"gpt-9": 1.0}),
        "quality.tasks.copa",
    ),
    "urgency out of range": (
        lambda s: s["qos_classes"]["long"].update(urgency=9),
        "qos_classes.long.urgency",
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_wrong_file_is_refused_naming_the_field(tmp_path: Path, case: str) -> None:
    change, field = BROKEN[case]
    with pytest.raises(ConfigError) as err:
        load(write(tmp_path, broken(change)))
    assert field in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_a_model_missing_from_the_quality_table_is_named(tmp_path: Path) -> None:
    def change(spec: dict) -> None:
        spec["quality"]["tasks"]["piqa"].pop("opt-6.7b")
        spec["deployments"]["embedded"].pop("quality_file")  # it would route on its own table

    spec = broken(change)
    with pytest.raises(
        ConfigError, match=r"quality.tasks.piqa: no value for 'tiny-l' or 'opt-6.7b'"
    ):
        resolve(load(write(tmp_path, spec)), "embedded", ROOT)


def test_not_yaml_and_unknown_deployment(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("slo: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(path)
    with pytest.raises(ConfigError, match="unknown deployment 'nope'"):
        load_deployment(ROOT / "models.yaml", "nope")


def test_api_keys_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QOS_PREMIUM_KEY", raising=False)
    assert load_deployment(ROOT / "models.yaml").api_keys == {}
    monkeypatch.setenv("QOS_PREMIUM_KEY", "s3cret")
    assert load_deployment(ROOT / "models.yaml").api_keys == {"s3cret": "premium"}


def test_one_slo_definition_and_the_reward() -> None:
    dep = load_deployment(name="paper-4gpu")
    # 40 ms per output token, from arrival to the last token.
    assert dep.slo.met(elapsed_s=4.0, output_tokens=100)
    assert not dep.slo.met(elapsed_s=4.01, output_tokens=100)
    assert not dep.slo.met(elapsed_s=0.0, output_tokens=0)
    assert dep.reward("hellaswag", "opt-1.3b", "free-tier", slo_met=True) == pytest.approx(0.78)
    assert dep.reward("hellaswag", "opt-1.3b", "free-tier", slo_met=False) == 0.0
    assert dep.reward("gsm8k", "opt-1.3b", "free-tier", slo_met=True) == 0.0
    assert dep.reward(None, None, "free-tier", slo_met=True) == 0.0


def measured(tmp_path: Path, scores: dict[str, dict[str, float]]) -> Path:
    """A table as `python -m serving.quality` writes it."""
    path = tmp_path / "quality.yaml"
    tasks = {
        task: {model: {"acc": acc, "stderr": 0.01, "n": 100} for model, acc in row.items()}
        for task, row in scores.items()
    }
    path.write_text(yaml.safe_dump({
        "command": "python -m serving.quality --limit 100", "date": "2026-11-26",
        "deployment": "embedded", "data": "fixtures", "num_fewshot": 0, "tasks": tasks,
    }))  # fmt: skip
    return path


def test_a_measured_quality_file_replaces_the_table(tmp_path: Path) -> None:
    table = measured(tmp_path, {
        "copa": {"tiny-s": 0.6, "tiny-m": 0.5, "tiny-l": 0.3},
        "piqa": {"tiny-s": 0.5, "tiny-m": 0.55, "tiny-l": 0.55},
    })  # fmt: skip
    spec = broken(lambda s: s["deployments"]["embedded"].update(quality_file=table.name))
    dep = resolve(load(write(tmp_path, spec)), "embedded", tmp_path)
    assert dep.quality == {
        "copa": {"tiny-s": 1.0, "tiny-m": pytest.approx(0.5 / 0.6), "tiny-l": 0.5},
        "piqa": {"tiny-s": pytest.approx(0.5 / 0.55), "tiny-m": 1.0, "tiny-l": 1.0},
    }
    assert "2026-11-26" in dep.quality_source and "--limit 100" in dep.quality_source
    # The other deployments keep the file-wide table.
    assert (
        resolve(load(write(tmp_path, spec)), "opt-cpu", tmp_path).quality["copa"]["opt-1.3b"] == 1
    )


@pytest.mark.parametrize(
    ("scores", "message"),
    [
        ({"copa": {"tiny-s": 0.6, "tiny-m": 0.5}}, r"tasks.copa: no score for tiny-l"),
        ({"copa": {"tiny-s": 0.0, "tiny-m": 0.0, "tiny-l": 0.0}}, r"copa: every model .* scores 0"),
        ({"copa": {"tiny-s": 1.5, "tiny-m": 0.5, "tiny-l": 0.5}}, r"tasks.copa.tiny-s.acc"),
    ],
)
def test_a_bad_quality_file_is_refused_naming_what(tmp_path: Path, scores, message) -> None:
    table = measured(tmp_path, scores)
    spec = broken(lambda s: s["deployments"]["embedded"].update(quality_file=table.name))
    with pytest.raises(ConfigError, match=message):
        resolve(load(write(tmp_path, spec)), "embedded", tmp_path)
    spec = broken(lambda s: s["deployments"]["embedded"].update(quality_file="absent.yaml"))
    with pytest.raises(ConfigError, match="absent.yaml: cannot read"):
        resolve(load(write(tmp_path, spec)), "embedded", tmp_path)


def test_a_policy_trained_on_another_quality_table_says_it_is_stale(tmp_path: Path) -> None:
    from router.policies import DqnPolicy

    paper = load_deployment(ROOT / "models.yaml", "paper-4gpu")
    policy = DqnPolicy.load(ROOT / "router/trained/paper-4gpu.npz")
    assert policy.stale_quality(paper) is None  # trained on Table 1 of Chuppala (2024), as shipped
    row = paper.quality["piqa"]
    other = replace(paper, quality={**paper.quality, "piqa": {**row, "opt-125m": 0.5}})
    stale = policy.stale_quality(other)
    assert stale is not None and "stale" in stale and "piqa" in stale and "hellaswag" not in stale


def test_the_deployment_a_server_serves_is_found_by_its_models(tmp_path: Path) -> None:
    shipped_file = ROOT / "models.yaml"
    assert deployment_serving(shipped_file, ["tiny-l", "tiny-s", "tiny-m"]).name == "embedded"
    # paper-4gpu, its twin and remote serve the OPT trio with one table: the first is taken.
    assert deployment_serving(shipped_file, ["opt-125m", "opt-1.3b", "opt-6.7b"]).name == (
        "paper-4gpu"
    )
    with pytest.raises(ConfigError, match="serves exactly the models null"):
        deployment_serving(shipped_file, ["null"])
    # Another deployment of the tiny models that scores them by Table 1 of Chuppala (2024), not
    # the measured one: which of the two served cannot be told, so neither is taken.
    seeded = {k: v for k, v in shipped()["deployments"]["embedded"].items() if k != "quality_file"}
    placement = shipped()["placements"]["embedded-cpu"]
    config = write_test_config(tmp_path, **{"embedded-seed": (placement, seeded)})
    with pytest.raises(ConfigError, match="embedded-seed of .* different quality tables"):
        deployment_serving(config, ["tiny-s", "tiny-m", "tiny-l"])


def test_an_engine_host_runs_the_replicas_its_placement_entries_name(tmp_path: Path) -> None:
    entries = [
        {"model": "tiny-s", "devices": ["cpu"], "engine_host": "node-1:7000"},
        {"model": "tiny-m", "device": "cpu", "engine_host": "node-2:7000"},
        {"model": "tiny-l", "device": "cpu"},
    ]
    twin = {"placement": "split", "profile": "embedded-measured", "engine": "simulated",
            "simulation": {"tokenizer": "tiny-s"}}  # fmt: skip
    deployment = load_deployment(write_test_config(tmp_path, split=(entries, twin)), "split")
    assert [r.name for r in deployment.replicas] == [
        "node-1:7000/cpu/tiny-s", "node-2:7000/cpu/tiny-m", "cpu/tiny-l"
    ]  # fmt: skip
    assert deployment.engine_hosts == ["node-1:7000", "node-2:7000"]
    # Each host runs its own as its own (no engine host of their own), under the same names.
    (mine,) = deployment.run_by("node-2:7000").replicas
    assert mine.name == "node-2:7000/cpu/tiny-m" and mine.engine_host is None
    assert [r.name for r in deployment.run_by(None).replicas] == ["cpu/tiny-l"]


def test_an_engine_host_name_with_hosts_behind_it_is_a_slot_per_host(tmp_path: Path) -> None:
    entries = [
        {"model": "tiny-s", "device": "cpu", "engine_host": "engines.ns.svc:7000", "hosts": 2},
        {"model": "tiny-m", "device": "cpu", "engine_host": "engines.ns.svc:7000", "hosts": 2},
    ]
    twin = {"placement": "fleet", "profile": "embedded-measured", "engine": "simulated",
            "simulation": {"tokenizer": "tiny-s"}}  # fmt: skip
    deployment = load_deployment(write_test_config(tmp_path, fleet=(entries, twin)), "fleet")
    assert [r.name for r in deployment.replicas] == [
        f"engines.ns.svc:7000#{slot}/cpu/{model}"
        for model in ("tiny-s", "tiny-m") for slot in (0, 1)
    ]  # fmt: skip
    assert deployment.discovered == {"engines.ns.svc:7000": 2}
    # Every host behind the name runs the entries once, under the names without a slot.
    assert [r.name for r in deployment.run_by("engines.ns.svc:7000").replicas] == [
        "engines.ns.svc:7000/cpu/tiny-s", "engines.ns.svc:7000/cpu/tiny-m"
    ]  # fmt: skip
    entries[1]["hosts"] = 3
    with pytest.raises(ConfigError, match="the same hosts"):
        load_deployment(write_test_config(tmp_path, fleet=(entries, twin)), "fleet")


def test_a_models_yaml_extends_another_with_its_own_placements_and_deployments(
    tmp_path: Path,
) -> None:
    """A site's file over the shipped one: its sections add to the shipped ones name by name,
    its other keys replace theirs, and relative paths stay the shipped file's."""
    shipped = ROOT / "models.yaml"
    mine = {"placement": "one", "profile": "embedded-measured", "engine": "simulated",
            "simulation": {"tokenizer": "tiny-s"}, "quality_file": "quality/embedded.yaml",
            "policy": {"name": "dqn", "path": "router/trained/embedded.npz"}}  # fmt: skip
    site = {"extends": str(shipped), "default_deployment": "mine", "deployments": {"mine": mine},
            "placements": {"one": [{"model": "tiny-s", "device": "cpu"}]}}  # fmt: skip
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    loaded = load_deployment(tmp_path / "site.yaml")
    assert loaded.name == "mine" and [r.name for r in loaded.replicas] == ["cpu/tiny-s"]
    assert loaded.policy.path == str(ROOT / "router" / "trained" / "embedded.npz")
    assert load_deployment(tmp_path / "site.yaml", "paper-4gpu-sim").models  # the shipped ones
    (tmp_path / "loop.yaml").write_text(yaml.safe_dump({"extends": "loop.yaml"}))
    with pytest.raises(ConfigError, match="extends itself"):
        load_deployment(tmp_path / "loop.yaml")
