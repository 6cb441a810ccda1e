"""Load models.yaml and resolve one named deployment into the plain data the other packages use."""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from config.quality import MeasuredQuality
from config.schema import (
    AdmissionSpec,
    Faults,
    Limits,
    ModelsFile,
    ModelSpec,
    PathMix,
    PolicySpec,
    Profile,
    ProfileModel,
    QosClass,
    ReplicaEntry,
    SimulationSpec,
    Slo,
    Tier,
    TinyBuild,
)

S = TypeVar("S", bound=BaseModel)

log = logging.getLogger(__name__)

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "models.yaml"
DEFAULT_SCRAPE_S = 0.1
"""How often a remote replica's /metrics is read, where its entry does not say: the Gateway API
Inference Extension's endpoint picker reads every 50 ms, vLLM's API-server coordinator
publishes every 100 ms."""


DEFAULT_MAX_MODEL_LEN = 2048
"""OPT's context, where the deployment's engine_args set no max_model_len."""


class ConfigError(ValueError):
    """models.yaml is unreadable or wrong; the message names the file and the field."""


RENAMED_DEPLOYMENTS = {"seed003-sim": "kubeai-l4-sim"}
"""Old deployment name -> its new name. For one release, asking for an old name that the file does
not define gives the deployment now under the new name (named by it), and the first such use in
a process logs a warning; then the old name goes (docs/deployments.md, "Renamed deployments")."""

_warned_renamed: set[str] = set()


def _current_name(spec: ModelsFile, name: str) -> str:
    """`name`, or the name it was renamed to where the file defines only that one."""
    new = RENAMED_DEPLOYMENTS.get(name)
    if name in spec.deployments or new is None or new not in spec.deployments:
        return name
    if name not in _warned_renamed:
        _warned_renamed.add(name)
        log.warning(
            "deployment %r is deprecated: it is now %r, and the old name will stop working in "
            "the next release",
            name,
            new,
        )
    return new


@dataclass(frozen=True)
class ReplicaConfig:
    name: str
    """Unique within the deployment, e.g. 'cuda:0/opt-6.7b' or 'cpu/tiny-l'."""
    model: str
    source: str
    """A Hugging Face id or an absolute local path."""
    device: str | None
    url: str | None
    served_name: str
    memory_fraction: float | None
    kv_cache_gib: float | None
    cpu_cores: str | None
    engine_args: dict[str, object]
    chat_template: str | None
    """The model's own override of its tokenizer's chat template."""
    fallback_chat_template: str | None
    """For tokenizers without a chat template."""
    build: TinyBuild | None
    scrape_s: float = 0.0
    """How often a remote replica's /metrics is read; 0: never."""
    kv_events: str | None = None
    """Where a remote replica publishes its KV cache events (ZMQ); None: nowhere we know."""
    kv_tokens: int | None = None
    """Tokens its KV cache holds, whole blocks (`kv_capacity`); None where nothing sizes it."""
    block_size: int = 16
    """Tokens per KV block: engine_args' block_size, else vLLM's default for the device."""
    engine_host: str | None = None
    """HOST:PORT of the engine host that runs it (`serving.engine_host --listen`); None: this
    server runs it."""
    slot: int | None = None
    """Where `engine_host` is a DNS name with several hosts behind it: which of them
    (`serving.discovery`) this replica is on. None: engine_host is one host."""

    @property
    def host_name(self) -> str:
        """The name its engine host knows it by: a slot's name without the slot."""
        if self.engine_host is None:
            return self.name
        return f"{self.engine_host}/{self.device}/{self.model}"

    def engine_int(self, name: str, default: int) -> int:
        """An integer vLLM argument (max_model_len, max_num_seqs) of `engine_args`, else
        `default`."""
        return _engine_int(name, self.engine_args.get(name, default))

    def engine_args_int(self, name: str) -> int | None:
        """An integer vLLM argument of `engine_args`, None where it is not set."""
        value = self.engine_args.get(name)
        return None if value is None else _engine_int(name, value)


@dataclass(frozen=True)
class Simulation:
    """A simulated deployment's engines, resolved (`config.schema.SimulationSpec`)."""

    tokenizer_source: str | None
    """Where the tokenizer that counts prompts is (None: each replica's own model's)."""
    tokenizer_build: TinyBuild | None
    """How to build it first, for a local tiny model."""
    time_scale: float
    """Already applied to the deployment's profile."""
    faults: Faults | None


@dataclass(frozen=True)
class Deployment:
    name: str
    replicas: list[ReplicaConfig]
    quality: dict[str, dict[str, float]]
    """task -> model -> quality, each task normalised so the deployment's best model scores 1."""
    quality_source: str
    """Where that table comes from: models.yaml's own, or a measured file and how it was made."""
    slo: Slo
    qos_classes: dict[str, QosClass]
    tiers: dict[str, Tier]
    anonymous_tier: str | None
    api_keys: dict[str, str] = field(repr=False)
    """key -> tier, for the keys that resolved (an unset key_env grants nothing)."""
    key_limits: dict[str, Limits] = field(repr=False)
    """key -> the limits of each key, its own or its tier's."""
    policy: PolicySpec
    profile: Profile | None
    admission: AdmissionSpec
    """Resolved: its rule is always set."""
    simulation: Simulation | None = None
    """Set where the engines are simulated."""
    paths: PathMix | None = None
    """The path mix its clients come over, where it names one."""
    path_mix: str | None = None
    """That mix's name."""

    @property
    def models(self) -> list[str]:
        """The deployment's models, each once, in placement order."""
        return list(dict.fromkeys(r.model for r in self.replicas))

    def with_admission(self, rule: Literal["deadline", "none"]) -> Deployment:
        """This deployment with admission control's rule replaced ('deadline' or 'none')."""
        admission = AdmissionSpec(rule=rule, lower_class_share=self.admission.lower_class_share)
        return replace(self, admission=_admission(self.name, admission, self.profile, self.remote))

    def with_time_scale(self, factor: float) -> Deployment:
        """This simulated deployment with every time of its profile multiplied by `factor`, on
        top of what models.yaml's `simulation.time_scale` already applied."""
        if self.simulation is None or self.profile is None:
            raise ConfigError(f"deployment {self.name!r}: a time scale needs engine: simulated")
        if not (math.isfinite(factor) and factor > 0):
            raise ConfigError(f"a time scale must be a number above 0, got {factor:g}")
        simulation = replace(self.simulation, time_scale=self.simulation.time_scale * factor)
        return replace(self, profile=_scaled(self.profile, factor), simulation=simulation)

    def with_policy_file(self, path: str | Path) -> Deployment:
        """This deployment routing with the trained policy at `path`, with or without a path
        mix; ConfigError if there is no file there."""
        if not Path(path).is_file():
            raise ConfigError(f"no policy file at {path}")
        where = str(Path(path).resolve())
        policy = self.policy.model_copy(update={"path": where, "net_path": None})
        return replace(self, policy=policy)

    def with_paths(self, name: str | None, mix: PathMix | None) -> Deployment:
        """This deployment with its clients on path mix `name` (None: paths not modelled)."""
        return replace(self, paths=mix, path_mix=name)

    @property
    def policy_file(self) -> str | None:
        """The trained policy it routes with: the network-aware one where its clients come over
        a path mix and it names one, else the network-blind one."""
        if self.paths is not None and self.policy.net_path is not None:
            return self.policy.net_path
        return self.policy.path

    @property
    def remote(self) -> bool:
        """Every replica is a server behind a URL."""
        return _all_remote(self.replicas)

    @property
    def engine_hosts(self) -> list[str]:
        """The engine hosts its placement names (HOST:PORT), in order."""
        return list(dict.fromkeys(r.engine_host for r in self.replicas if r.engine_host))

    @property
    def discovered(self) -> dict[str, int]:
        """The engine hosts found through DNS: the NAME:PORT placement entries name, and how
        many hosts behind it the front-ends use."""
        slots: dict[str, int] = {}
        for r in self.replicas:
            if r.engine_host is not None and r.slot is not None:
                slots[r.engine_host] = max(slots.get(r.engine_host, 0), r.slot + 1)
        return slots

    def run_by(self, engine_host: str | None) -> Deployment:
        """The replicas engine host `engine_host` runs, as its own (their names keep the host;
        behind a DNS name, every host runs the same ones); None: those a server runs itself,
        neither behind a URL nor on an engine host."""
        mine = [replace(r, name=r.host_name, engine_host=None, slot=None)
                for r in self.replicas if r.engine_host == engine_host and not r.slot]  # fmt: skip
        if engine_host is None:
            mine = [r for r in mine if r.url is None]
        return replace(self, replicas=mine)

    @property
    def max_batch(self) -> int | None:
        """vLLM's cap on a batch (`max_num_seqs`), where every replica has the same one."""
        return self.engine_arg("max_num_seqs")

    @property
    def max_model_len(self) -> int:
        """The longest context any of its replicas takes (engine_args' max_model_len, else
        OPT's): the longest prompt the gateway lets in, and what a request that sets no
        max_tokens may run to (vLLM's default: all the context its prompt leaves)."""
        return max(r.engine_int("max_model_len", DEFAULT_MAX_MODEL_LEN) for r in self.replicas)

    @property
    def hash_block(self) -> int:
        """The block size prompts' hashes are cut at (`Request.blocks`): the smallest KV block
        of its replicas, which every larger one of theirs is a multiple of."""
        return min(r.block_size for r in self.replicas)

    def engine_arg(self, name: str) -> int | None:
        """An integer vLLM argument where every replica has the same one."""
        values = {r.engine_args.get(name) for r in self.replicas}
        value = values.pop() if len(values) == 1 else None
        return _engine_int(name, value) if value is not None else None

    @property
    def tasks(self) -> list[str]:
        return list(self.quality)

    def reward(self, task: str | None, model: str | None, qos_class: str, slo_met: bool) -> float:
        """The router's reward for one finished request: the model's quality on the task, scaled by
        the class's weight, if the SLO was met; else 0. Unknown tasks or models score 0."""
        if not slo_met or task is None or model is None:
            return 0.0
        quality = self.quality.get(task, {}).get(model, 0.0)
        cls = self.qos_classes.get(qos_class)
        return quality * (cls.reward_weight if cls is not None else 1.0)


def load(path: str | Path = DEFAULT_PATH) -> ModelsFile:
    return load_with_base(Path(path))[0]


EXTENDED = frozenset(
    {"models", "placements", "profiles", "qos_classes", "tiers", "path_mixes", "deployments"}
)
"""The sections of a models.yaml that one which `extends` it adds to, name by name; it replaces
the others whole."""


def load_with_base(path: Path) -> tuple[ModelsFile, Path]:
    """models.yaml at `path`, on top of the file it `extends` (a site's own placements and
    deployments over the shipped ones: a Kubernetes ConfigMap); and the folder relative paths
    resolve against: the extended file's (the shipped one's), whose model, policy and quality
    paths are relative, and the extending file's own are taken as written there."""
    raw, base = _yaml(path), path.parent
    seen = [path.resolve()]
    while isinstance(raw, dict) and "extends" in raw:
        below = (base / str(raw.pop("extends"))).resolve()
        if below in seen:
            raise ConfigError(f"{path}: extends itself, through {below}")
        seen.append(below)
        under, base = _yaml(below), below.parent
        if not isinstance(under, dict):
            raise ConfigError(f"{below}: not a models.yaml")
        for key, value in raw.items():
            if key in EXTENDED and isinstance(value, dict) and isinstance(under.get(key), dict):
                under[key] = {**under[key], **value}
            else:
                under[key] = value
        raw = under
    return _validate(path, raw, ModelsFile), base


def _read(path: Path, schema: type[S]) -> S:
    """A YAML file read as `schema`; ConfigError naming the file and what is wrong."""
    return _validate(path, _yaml(path), schema)


def _yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def _validate(path: Path, raw: Any, schema: type[S]) -> S:
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def resolve(
    spec: ModelsFile, name: str | None = None, base_dir: str | Path = DEFAULT_PATH.parent
) -> Deployment:
    """The deployment `name` (default: the file's default) as plain data. An old name in
    `RENAMED_DEPLOYMENTS` that the file does not define gives the renamed deployment.

    Relative model paths resolve against `base_dir`, the directory that holds models.yaml.
    """
    name = _current_name(spec, name or spec.default_deployment)
    if name not in spec.deployments:
        raise ConfigError(f"unknown deployment {name!r} (known: {', '.join(spec.deployments)})")
    dep = spec.deployments[name]
    profile = spec.profiles[dep.profile] if dep.profile is not None else None
    replicas = _replicas(spec, dep.placement, dep.engine_args, Path(base_dir), profile)
    models = list(dict.fromkeys(r.model for r in replicas))
    simulation = _simulation(spec, name, replicas, Path(base_dir))
    quality, quality_source = _quality(spec, models, dep.quality_file, Path(base_dir))
    return Deployment(
        name=name,
        replicas=replicas,
        quality=quality,
        quality_source=quality_source,
        slo=spec.slo,
        qos_classes=spec.qos_classes,
        tiers=spec.tiers,
        anonymous_tier=spec.anonymous_tier,
        api_keys={k: key.tier for key in spec.api_keys if (k := key.resolve())},
        key_limits={
            k: key.limits or spec.tiers[key.tier].limits
            for key in spec.api_keys
            if (k := key.resolve())
        },
        policy=_policy(dep.policy, Path(base_dir)),
        profile=_profile(spec, dep.profile, simulation),
        admission=_admission(name, dep.admission, dep.profile, _all_remote(replicas)),
        simulation=simulation,
        paths=spec.path_mixes[dep.paths] if dep.paths is not None else None,
        path_mix=dep.paths,
    )


def _simulation(
    spec: ModelsFile, name: str, replicas: list[ReplicaConfig], base_dir: Path
) -> Simulation | None:
    dep = spec.deployments[name]
    if dep.engine != "simulated":
        return None
    sim = dep.simulation or SimulationSpec()
    if sim.faults is not None and sim.faults.replicas is not None:
        names = [r.name for r in replicas]
        if unknown := [r for r in sim.faults.replicas if r not in names]:
            raise ConfigError(
                f"deployments.{name}.simulation.faults.replicas: unknown {', '.join(unknown)} "
                f"(known: {', '.join(names)})"
            )
    source = build = None
    if sim.tokenizer is not None:
        model = spec.models[sim.tokenizer]
        source, build = _source(model.source, model.build, base_dir), model.build
    return Simulation(source, build, sim.time_scale, sim.faults)


def _profile(spec: ModelsFile, name: str | None, simulation: Simulation | None) -> Profile | None:
    """The deployment's profile; a simulated one's with its times scaled, so that the engines,
    admission control and the simulator all keep the same time."""
    if name is None:
        return None
    profile = spec.profiles[name]
    return _scaled(profile, simulation.time_scale) if simulation else profile


def _scaled(profile: Profile, factor: float) -> Profile:
    if factor == 1.0:
        return profile
    models = {
        name: ProfileModel(
            prefill_s_per_token=m.prefill_s_per_token * factor,
            step_s={b: t * factor for b, t in m.step_s.items()},
        )
        for name, m in profile.models.items()
    }
    return profile.model_copy(
        update={"models": models, "how": f"{profile.how} Times scaled by {factor:g}."}
    )


def _scrape_s(given: float | None, url: str | None) -> float:
    """How often a replica's /metrics is read: as given, else the default for a remote one."""
    if given is not None:
        return given
    return DEFAULT_SCRAPE_S if url is not None else 0.0


def _all_remote(replicas: list[ReplicaConfig]) -> bool:
    return all(r.url is not None for r in replicas)


def _admission(
    name: str, admission: AdmissionSpec, profile: object | None, remote: bool
) -> AdmissionSpec:
    """The rule resolved: deadline where it has times to go on, a profile or remote servers
    whose times it learns (`router.admission.UNPROFILED`)."""
    if admission.rule == "deadline" and profile is None and not remote:
        raise ConfigError(
            f"deployments.{name}.admission: rule 'deadline' needs the deployment's latency "
            "profile (profile: ...), unless every replica is remote (url)"
        )
    rule = admission.rule or ("deadline" if profile or remote else "none")
    return admission.model_copy(update={"rule": rule})


def _policy(policy: PolicySpec, base_dir: Path) -> PolicySpec:
    files = {"path": policy.path, "net_path": policy.net_path}
    return policy.model_copy(
        update={k: str(base_dir / v) for k, v in files.items() if v and not Path(v).is_absolute()}
    )


def load_deployment(
    path: str | Path = DEFAULT_PATH, name: str | None = None, paths: str | None = None
) -> Deployment:
    """Deployment `name` of models.yaml at `path`; with `paths`, its clients on that path mix
    instead of the one it names."""
    spec, base_dir = load_with_base(Path(path).resolve())
    deployment = resolve(spec, name, base_dir)
    if paths is None:
        return deployment
    if paths not in spec.path_mixes:
        known = ", ".join(spec.path_mixes) or "none"
        raise ConfigError(f"{path}: unknown path mix {paths!r} (known: {known})")
    return deployment.with_paths(paths, spec.path_mixes[paths])


def _engine_int(name: str, value: object) -> int:
    """`value` of engine argument `name` as an integer, taken as `int()` takes it."""
    if not isinstance(value, int | float | str):  # YAML's other values, which int() refuses
        raise TypeError(f"engine argument {name} must be an integer, got {value!r}")
    return int(value)


def _replicas(
    spec: ModelsFile,
    placement: str,
    engine_args: dict[str, object],
    base_dir: Path,
    profile: Profile | None = None,
) -> list[ReplicaConfig]:
    replicas: list[ReplicaConfig] = []
    for entry in spec.placements[placement]:
        model = spec.models[entry.model]
        source = _source(model.source, model.build, base_dir)
        locations: list[tuple[str | None, str | None, int | None]]
        slots: list[int | None] = list(range(entry.hosts)) if entry.hosts else [None]
        locations = [(d, None, s) for s in slots for d in entry.device_list()]
        for device, url, slot in locations or [(None, entry.url, None)]:
            where = device if url is None else url.split("//", 1)[-1].split("/", 1)[0]
            if entry.engine_host is not None:  # each host has its own cuda:0
                host = entry.engine_host if slot is None else f"{entry.engine_host}#{slot}"
                where = f"{host}/{device}"
            args = {**engine_args, **entry.engine_args}
            block_size = _engine_int(
                "block_size", args.get("block_size", CPU_BLOCK_SIZE if device == "cpu" else 16)
            )
            replicas.append(
                ReplicaConfig(
                    name=f"{where}/{entry.model}",
                    model=entry.model,
                    source=source,
                    device=device,
                    url=url,
                    served_name=entry.served_name or model.source,
                    memory_fraction=entry.memory_fraction,
                    kv_cache_gib=entry.kv_cache_gib,
                    cpu_cores=entry.cpu_cores,
                    engine_args=args,
                    chat_template=model.chat_template,
                    fallback_chat_template=spec.chat_template,
                    build=model.build,
                    scrape_s=_scrape_s(entry.scrape_s, url),
                    kv_events=entry.kv_events,
                    kv_tokens=kv_capacity(
                        f"placements.{placement}: {entry.model}", model, entry, profile, block_size
                    ),
                    block_size=block_size,
                    engine_host=entry.engine_host,
                    slot=slot,
                )
            )
    counts = {(e.engine_host, e.hosts) for e in spec.placements[placement] if e.engine_host}
    if len(counts) > len({host for host, _ in counts}):
        raise ConfigError(f"placements.{placement}: the entries on one engine_host must give "
                          "the same hosts")  # fmt: skip
    names = [r.name for r in replicas]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"placements.{placement}: replicas repeat: {', '.join(dupes)}")
    return replicas


CPU_BLOCK_SIZE = 128
"""vLLM's default KV block on CPU (vllm/platforms/cpu.py); 16 on GPUs."""

GIB = 2**30


def kv_capacity(
    where: str,
    model: ModelSpec,
    entry: ReplicaEntry,
    profile: Profile | None,
    block_size: int,
) -> int | None:
    """Tokens a replica's KV cache holds, in whole blocks, as vLLM sizes it: on CPU the
    placement's kv_cache_gib exactly; on a GPU the placement's share of the device's memory
    (the profile's device_memory_gib) less the model's weights and the profile's reserve. Each
    token takes 2 (keys and values) x layers x KV heads x head size x bytes of the model's
    shape. None where something is missing: the simulator then keeps no cache for it."""
    shape = model.model_shape()
    if shape is None:
        return None
    if entry.kv_cache_gib is not None:
        room = entry.kv_cache_gib * GIB
    elif entry.memory_fraction is not None and profile and profile.device_memory_gib:
        share = entry.memory_fraction * profile.device_memory_gib * GIB
        room = share - shape.weights_bytes - profile.reserved_gib * GIB
        if room <= 0:
            raise ConfigError(
                f"{where}: its {share / GIB:.2f} GiB share of the device holds no KV cache "
                f"beside {shape.weights_bytes / GIB:.2f} GiB of weights and the profile's "
                f"{profile.reserved_gib:g} GiB reserve"
            )
    else:
        return None
    return int(room // shape.kv_bytes_per_token) // block_size * block_size


def _source(source: str, build: TinyBuild | None, base_dir: Path) -> str:
    """A model's source: a hub id as it is, a local directory made absolute."""
    if build is not None or source.startswith((".", "/")):
        return str((base_dir / source).resolve())
    return source


def _quality(
    spec: ModelsFile, models: list[str], quality_file: str | None, base_dir: Path
) -> tuple[dict[str, dict[str, float]], str]:
    """The deployment's quality table, normalised, and where it comes from."""
    if quality_file is None:
        rows = {
            task: {m: _stand_in_value(spec, task, row, m) for m in models}
            for task, row in spec.quality.tasks.items()
        }
        return _normalised(rows, "quality.tasks"), spec.quality.source
    path = base_dir / quality_file
    measured = _read(path, MeasuredQuality)
    rows = {}
    for task, row in measured.accuracy().items():
        if missing := [m for m in models if m not in row]:
            raise ConfigError(f"{path}: tasks.{task}: no score for {', '.join(missing)}")
        rows[task] = {m: row[m] for m in models}
    return _normalised(rows, f"{path}: tasks"), measured.describe()


def _stand_in_value(spec: ModelsFile, task: str, row: dict[str, float], model: str) -> float:
    stand_in = spec.models[model].stands_in_for
    key = model if model in row else stand_in
    if key not in row:
        raise ConfigError(
            f"quality.tasks.{task}: no value for {model!r}"
            + (f" or {stand_in!r}, which it stands in for" if stand_in else "")
        )
    return row[key]


def _normalised(rows: dict[str, dict[str, float]], where: str) -> dict[str, dict[str, float]]:
    quality: dict[str, dict[str, float]] = {}
    for task, values in rows.items():
        best = max(values.values())
        if best <= 0:
            raise ConfigError(f"{where}.{task}: every model of the deployment scores 0")
        quality[task] = {model: v / best for model, v in values.items()}
    return quality


def deployment_serving(path: str | Path, models: Collection[str]) -> Deployment:
    """The deployment of models.yaml at `path` that serves exactly `models` (a server's
    /v1/models, less `auto`): the file's default where it does, else the first that does. Where
    several do, their quality tables must agree, since a load generator scores answers with it.
    Raises ConfigError saying why where none does, or where those that do disagree."""
    path = Path(path).resolve()
    spec, base_dir = load_with_base(path)
    serving, unreadable = [], []
    for name in sorted(spec.deployments, key=lambda name: name != spec.default_deployment):
        try:
            deployment = resolve(spec, name, base_dir)
        except ConfigError:  # a file it names is missing, say: not the server's, or not here
            unreadable.append(name)
            continue
        if set(deployment.models) == set(models):
            serving.append(deployment)
    if not serving:
        unread = f" ({', '.join(unreadable)} could not be read)" if unreadable else ""
        raise ConfigError(
            f"no deployment of {path} serves exactly the models {', '.join(sorted(models))}"
            + unread
        )
    disagree = [d.name for d in serving if d.quality != serving[0].quality]
    if disagree:
        raise ConfigError(
            f"deployments {serving[0].name} and {', '.join(disagree)} of {path} serve these "
            "models with different quality tables"
        )
    return serving[0]
