"""The typed form of models.yaml.

Every section is a pydantic model that forbids unknown keys, so a typo is an error that names the
field. Cross-references (a deployment's placement, a tier's classes, a quality row's models) are
checked once, here, so no later code has to.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Slo(Strict):
    tpot_s: PositiveFloat
    """Deadline per output token: (last token time - arrival) / output tokens must not exceed it."""

    def met(self, elapsed_s: float, output_tokens: int) -> bool:
        """The one SLO test, used by the gateway's metrics, the load generator and the simulator:
        `elapsed_s` runs from the request's arrival to its last token."""
        return output_tokens > 0 and elapsed_s <= self.tpot_s * output_tokens


class TinyBuild(Strict):
    """Shape of a tiny OPT built locally with random weights."""

    hidden_size: Annotated[int, Field(gt=0)]
    num_layers: Annotated[int, Field(gt=0)]
    num_heads: Annotated[int, Field(gt=0)]
    ffn_dim: Annotated[int, Field(gt=0)]
    max_positions: Annotated[int, Field(gt=0)] = 2048
    seed: int = 0

    @model_validator(mode="after")
    def _head_dim(self) -> TinyBuild:
        head_dim, rest = divmod(self.hidden_size, self.num_heads)
        if rest or head_dim not in (64, 128):
            raise ValueError(
                "hidden_size / num_heads must be 64 or 128, the head sizes of vLLM's CPU "
                f"attention kernel; got {self.hidden_size} / {self.num_heads}"
            )
        return self


class ModelShape(Strict):
    """A model's public dimensions, as far as they size its weights and its KV cache."""

    params_b: PositiveFloat
    """Parameters, in billions."""
    layers: Annotated[int, Field(gt=0)]
    kv_heads: Annotated[int, Field(gt=0)]
    """Key-value heads per layer (as many as the attention heads, without grouped queries)."""
    head_dim: Annotated[int, Field(gt=0)]
    weight_bytes: PositiveFloat = 2.0
    """Bytes per parameter: 2 for fp16 or bf16, 1 for fp8."""
    kv_bytes: PositiveFloat = 2.0
    """Bytes per cached key or value element (1 with vLLM's --kv-cache-dtype fp8)."""

    @property
    def kv_bytes_per_token(self) -> float:
        """One token's keys and values over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    @property
    def weights_bytes(self) -> float:
        return self.params_b * 1e9 * self.weight_bytes


class ModelSpec(Strict):
    source: str
    """A Hugging Face id, or a local directory (relative paths are relative to models.yaml)."""
    stands_in_for: str | None = None
    """Another model whose quality row this one takes (the tiny models stand in for OPT sizes)."""
    build: TinyBuild | None = None
    """If set, the model is built at `source` on first use instead of downloaded."""
    chat_template: str | None = None
    """Overrides the tokenizer's chat template and the file-wide fallback."""
    shape: ModelShape | None = None
    """Sizes its KV cache where a placement gives a share of a device's memory; a tiny model's
    comes from its build."""

    def model_shape(self) -> ModelShape | None:
        """Its shape, given or, for a tiny model, from its build."""
        if self.shape is not None or self.build is None:
            return self.shape
        b = self.build
        vocab = 50272  # OPT's embedding rows, which the tiny builds keep
        params = 12 * b.num_layers * b.hidden_size**2 + (vocab + b.max_positions) * b.hidden_size
        return ModelShape(
            params_b=params / 1e9,
            layers=b.num_layers,
            kv_heads=b.num_heads,
            head_dim=b.hidden_size // b.num_heads,
            weight_bytes=4.0,  # built in float32, as the CPU engine runs them
            kv_bytes=4.0,
        )


class Quality(Strict):
    source: str
    derived: dict[str, str] = {}
    """Rows that were not measured, and how they were made."""
    tasks: dict[str, dict[str, Annotated[float, Field(ge=0)]]]
    """task -> model -> quality."""


_CPU_LIST = r"^\d+(-\d+)?(,\d+(-\d+)?)*$"
_HOST_PORT = r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$"
"""HOST:PORT, an IPv6 host in brackets."""


class ReplicaEntry(Strict):
    """One line of a placement: a model on one device, on several, or behind a URL."""

    model: str
    device: str | None = None
    devices: list[str] | None = None
    url: str | None = None
    served_name: str | None = None
    """The name the server at `url` knows the model by; defaults to the model's source."""
    memory_fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    kv_cache_gib: PositiveFloat | None = None
    cpu_cores: Annotated[str, Field(pattern=_CPU_LIST)] | None = None
    """Cores for the engine's processes, as VLLM_CPU_OMP_THREADS_BIND takes them: "0-2,5"."""
    engine_args: dict[str, object] = {}
    scrape_s: Annotated[float, Field(ge=0)] | None = None
    """With url: seconds between reads of the server's /metrics (the URL's origin), whose
    load (vLLM's running and waiting requests, KV cache) the router and admission control see
    beside the gateway's own; 0: never read. Default 0.1."""
    kv_events: Annotated[str, Field(pattern=r"^(tcp|ipc)://")] | None = None
    """With url: the ZMQ endpoint where that vLLM publishes its KV cache events (its
    --kv-events-config endpoint, with a host: "tcp://10.0.0.5:5557"), which the precise
    prefix index (policy prefix-precise) reads."""
    engine_host: Annotated[str, Field(pattern=_HOST_PORT)] | None = None
    """With device or devices: the engine host (`python -m serving.engine_host --listen`, on
    the node with those devices) that runs these replicas, as HOST:PORT; the front-ends reach
    them over the engine link on TCP. None: this server's own engines."""
    hosts: PositiveInt | None = None
    """With engine_host: its HOST is a DNS name (a Kubernetes headless Service) whose every
    address is an engine host running these replicas, and the front-ends route to up to `hosts`
    of them, found again every few seconds (`serving.discovery`). None: HOST is one host."""

    @model_validator(mode="after")
    def _one_location(self) -> ReplicaEntry:
        given = [name for name in ("device", "devices", "url") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of device, devices or url (got {given or 'none'})")
        for name in ("scrape_s", "kv_events"):
            if getattr(self, name) is not None and self.url is None:
                raise ValueError(f"{name} is only for a replica behind a url")
        if self.engine_host is not None and self.url is not None:
            raise ValueError("engine_host is for replicas on devices, not behind a url")
        if self.hosts is not None and self.engine_host is None:
            raise ValueError("hosts counts the engine hosts behind an engine_host's DNS name")
        for device in self.device_list():
            if not (device == "cpu" or device.startswith("cuda:")):
                raise ValueError(f"device must be 'cpu' or 'cuda:N', got {device!r}")
        return self

    def device_list(self) -> list[str]:
        if self.devices is not None:
            return self.devices
        return [self.device] if self.device is not None else []


class ProfileModel(Strict):
    prefill_s_per_token: Annotated[float, Field(ge=0)]
    step_s: dict[Annotated[int, Field(gt=0)], PositiveFloat]
    """Batch size -> time of one decode step."""


class Profile(Strict):
    hardware: str
    source: Literal["measured", "derived"]
    how: str
    """For measured profiles: where, when and by which command. For derived ones: the method."""
    interference: Annotated[float, Field(ge=0)] = 0.0
    """Slowdown per busy replica on the same device: an iteration takes (1 + interference x k)
    times as long while k neighbours are busy."""
    device_memory_gib: PositiveFloat | None = None
    """Memory of one device, as vLLM sees it. With a placement's memory_fraction and a model's
    shape it sizes each replica's KV cache; without it, the simulator's replicas keep no cache
    and never run out of room (as before prefix caching was modelled)."""
    reserved_gib: Annotated[float, Field(ge=0)] = 1.0
    """Memory an engine's share holds beside weights and KV cache: activations at its largest
    batch of tokens, CUDA graphs, the CUDA context. Assumed, not measured."""
    models: dict[str, ProfileModel]


class QosClass(Strict):
    urgency: Annotated[int, Field(ge=0, le=7)]
    """RFC 9218 urgency: 0 is the most urgent."""
    deadline_s: PositiveFloat
    """Time from arrival to the first token."""
    level: Literal["high", "low"]
    """The multi-level scheduler's queue."""
    reward_weight: Annotated[float, Field(ge=0)] = 1.0


class Limits(Strict):
    """What one API key may ask of the server; what is not given is not limited."""

    requests_per_s: PositiveFloat | None = None
    """The sustained request rate (a token bucket)."""
    burst: Annotated[int, Field(ge=1)] | None = None
    """How many requests may come at once above that rate; default: one second's worth."""
    concurrent: Annotated[int, Field(ge=1)] | None = None
    """Requests in flight at once."""


_TUNNEL_TARGET = r"^(\[[0-9A-Fa-f:.]+\]|[^\s:\[\]*]+):(\*|[0-9]{1,5})$"
"""`host:port` or `host:*`: what `transport.masque.AllowList` reads (it checks the rest)."""


class Tier(Strict):
    classes: list[str]
    default: str
    limits: Limits = Limits()
    """For each key of the tier, its own; the anonymous tier's requests share one."""
    trusted_edge: bool = False
    """Keys of this tier belong to edge front-ends: a request that carries one in `x-edge-key`
    keeps the arrival time and class that the edge forwards (`x-edge-age`, `x-edge-qos-class`,
    `x-edge-tier`) instead of being timed and classified again here."""
    admin: bool = False
    """Keys of this tier may see the operator's pages (`/dashboard` and its feed) from anywhere;
    without one, only a client on the server's own machine (loopback) may."""
    tunnels: list[Annotated[str, Field(pattern=_TUNNEL_TARGET)]] = []
    """MASQUE: the UDP targets (`host:port`, `host:*`, IPv6 as `[addr]:port`) that keys of this
    tier may reach through a CONNECT-UDP proxy (`python -m transport.frontend --masque`). Empty:
    no tunnels (403). There is no wildcard host, so a proxy is never an open relay."""

    @model_validator(mode="after")
    def _default_granted(self) -> Tier:
        if self.default not in self.classes:
            raise ValueError(f"default {self.default!r} is not among classes {self.classes}")
        return self


class ApiKey(Strict):
    key: str | None = None
    key_env: str | None = None
    """Name of an environment variable that holds the key; an unset variable grants nothing."""
    tier: str
    limits: Limits | None = None
    """This key's own limits, instead of its tier's."""

    @model_validator(mode="after")
    def _one_source(self) -> ApiKey:
        if (self.key is None) == (self.key_env is None):
            raise ValueError("give exactly one of key or key_env")
        return self

    def resolve(self) -> str | None:
        return self.key if self.key is not None else os.environ.get(self.key_env or "") or None


class Bursts(Strict):
    """Bursty loss: the Gilbert-Elliott chain of `netsim.link.GilbertElliott` (Chatterbox
    §4.1), with its defaults, Chatterbox's default case: about 15% loss in bursts of 200 ms."""

    good_slots: Annotated[float, Field(ge=1)] = 10.0
    bad_slots: Annotated[float, Field(ge=1)] = 2.0
    bad_loss: Annotated[float, Field(ge=0, le=1)] = 0.9
    good_loss: Annotated[float, Field(ge=0, le=1)] = 0.0
    slot_s: PositiveFloat = 0.1

    @property
    def mean_loss(self) -> float:
        bad_share = self.bad_slots / (self.good_slots + self.bad_slots)
        return bad_share * self.bad_loss + (1 - bad_share) * self.good_loss


class PathSpec(Strict):
    """One kind of client network path, the same both ways."""

    rtt_s: Annotated[float, Field(ge=0, le=10)]
    rate_bps: PositiveFloat
    loss: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """i.i.d. loss per packet; `bursts` instead for bursty loss."""
    bursts: Bursts | None = None
    share: PositiveFloat = 1.0
    """Of the clients, relative to the mix's other paths."""

    @property
    def mean_loss(self) -> float:
        return self.bursts.mean_loss if self.bursts is not None else self.loss


class PathMix(Strict):
    """The network paths a deployment's clients come over, and how many come over each: what the
    router's simulator draws each request's path from."""

    source: str | None = None
    paths: Annotated[dict[str, PathSpec], Field(min_length=1)]


class PolicySpec(Strict):
    name: str
    max_running: Annotated[int, Field(gt=0)] = 8
    """quality-threshold: a replica at or above this many running requests counts as full."""
    thresholds: dict[str, Annotated[int, Field(gt=0)]] = {}
    """quality-threshold: per-model overrides of max_running (as tuned by grid search)."""
    model: str | None = None
    """static: the one model every request goes to."""
    path: str | None = None
    """dqn: the trained policy file (.npz), relative to models.yaml's directory."""
    net_path: str | None = None
    """dqn: the network-aware policy file, trained with a path mix (`router.train --paths`); it
    routes instead of `path` where the deployment's clients come over a path mix."""


class AdmissionSpec(Strict):
    """Admission control (`router/admission.py`): what is refused at once under overload."""

    rule: Literal["deadline", "none"] | None = None
    """deadline: refuse a request that no replica is expected to start within its class's budget
    (needs the deployment's latency profile); none: dispatch everything. Default: deadline where
    the deployment names a profile, else none."""
    lower_class_share: Annotated[float, Field(gt=0, le=1)] = 0.25
    """Every class but the most urgent may wait at most this share of the most urgent class's
    deadline (and never past its own), so that under overload the lower classes are shed first."""


class Faults(Strict):
    """Failures a simulated deployment injects, for chaos runs; none unless a deployment names
    them, and only a simulated one may."""

    replicas: list[str] | None = None
    """Names of the replicas that fail ("cuda:0/opt-125m"); default: all."""
    fail_after_s: PositiveFloat | None = None
    """The engine dies this long after the server started (once): what it holds ends as engine
    errors, and its supervisor brings it back."""
    restart_s: Annotated[float, Field(ge=0)] = 5.0
    """How long bringing a dead engine back takes."""
    error_rate: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Share of requests that fail part-way with an engine error."""
    seed: int = 0


class SimulationSpec(Strict):
    """How a simulated deployment's engines behave (`serving.engines.simulated`)."""

    tokenizer: str | None = None
    """A model whose tokenizer counts the prompts (one with a build is built locally on first
    use); default: each replica's own model's."""
    time_scale: PositiveFloat = 1.0
    """Every time of the latency profile is multiplied by it, for the engines and for admission
    control alike: 0.01 makes engines a hundred times faster than the profile."""
    faults: Faults | None = None


class DeploymentSpec(Strict):
    placement: str
    profile: str | None = None
    engine: Literal["simulated"] | None = None
    """simulated: every replica is a simulated engine that keeps the profile's time with no model
    behind it (nothing touches a device); default: vLLM on the placement's devices, or a remote
    server at its url."""
    simulation: SimulationSpec | None = None
    """Only with engine: simulated."""
    policy: PolicySpec = PolicySpec(name="quality-threshold")
    admission: AdmissionSpec = AdmissionSpec()
    engine_args: dict[str, object] = {}
    """Passed to every vLLM engine of the deployment (a replica's own engine_args win)."""
    paths: str | None = None
    """The path mix (`path_mixes`) its clients come over: the router simulates, trains and
    evaluates with it, and routes on each request's path."""
    quality_file: str | None = None
    """A quality table measured by `python -m serving.quality` (relative to models.yaml's
    directory): the router's reward, its simulator and its policies' check use it instead of
    the file-wide `quality`."""


class ModelsFile(Strict):
    slo: Slo
    chat_template: str | None = None
    models: dict[str, ModelSpec]
    quality: Quality
    placements: dict[str, list[ReplicaEntry]]
    profiles: dict[str, Profile] = {}
    qos_classes: dict[str, QosClass]
    tiers: dict[str, Tier]
    anonymous_tier: str | None
    api_keys: list[ApiKey] = []
    path_mixes: dict[str, PathMix] = {}
    deployments: dict[str, DeploymentSpec]
    default_deployment: str

    @model_validator(mode="after")
    def _references(self) -> ModelsFile:
        errors: list[str] = []

        def need(kind: str, name: str | None, known: dict, where: str) -> None:
            if name is not None and name not in known:
                errors.append(f"{where}: unknown {kind} {name!r} (known: {', '.join(known)})")

        for name, spec in self.models.items():
            need("model", spec.stands_in_for, self.models, f"models.{name}.stands_in_for")
        for task, row in self.quality.tasks.items():
            for model in row:
                need("model", model, self.models, f"quality.tasks.{task}")
        for name, entries in self.placements.items():
            share: dict[str, float] = {}
            for i, entry in enumerate(entries):
                need("model", entry.model, self.models, f"placements.{name}[{i}].model")
                for device in entry.device_list():
                    if device != "cpu" and entry.memory_fraction is not None:
                        share[device] = share.get(device, 0.0) + entry.memory_fraction
            for device, total in share.items():
                if total >= 1:
                    errors.append(
                        f"placements.{name}: memory fractions on {device} add up to {total:.2f}"
                    )
        for name, profile in self.profiles.items():
            for model in profile.models:
                need("model", model, self.models, f"profiles.{name}.models")
        for name, tier in self.tiers.items():
            for cls in tier.classes:
                need("QoS class", cls, self.qos_classes, f"tiers.{name}.classes")
        need("tier", self.anonymous_tier, self.tiers, "anonymous_tier")
        for i, key in enumerate(self.api_keys):
            need("tier", key.tier, self.tiers, f"api_keys[{i}].tier")
        for name, dep in self.deployments.items():
            need("placement", dep.placement, self.placements, f"deployments.{name}.placement")
            need("profile", dep.profile, self.profiles, f"deployments.{name}.profile")
            need("path mix", dep.paths, self.path_mixes, f"deployments.{name}.paths")
            errors += self._simulated(name, dep)
        need("deployment", self.default_deployment, self.deployments, "default_deployment")
        if errors:
            raise ValueError("; ".join(errors))
        return self

    def _simulated(self, name: str, dep: DeploymentSpec) -> list[str]:
        where = f"deployments.{name}"
        if dep.engine != "simulated":
            # Faults live only here, so that no flag or stray key can inject them elsewhere.
            return [f"{where}.simulation: only a deployment with engine: simulated takes it"] * (
                dep.simulation is not None
            )
        errors = []
        if dep.profile is None:
            errors.append(f"{where}: engine: simulated needs a latency profile (profile: ...)")
        if any(e.url is not None for e in self.placements.get(dep.placement, [])):
            errors.append(f"{where}: engine: simulated cannot simulate a remote (url) replica")
        profile = self.profiles.get(dep.profile) if dep.profile is not None else None
        if profile is not None:
            models = {e.model for e in self.placements.get(dep.placement, [])}
            if missing := sorted(models - set(profile.models)):
                errors.append(
                    f"{where}: profile {dep.profile!r} has no step times for {', '.join(missing)}, "
                    "which a simulated engine needs"
                )
        simulation = dep.simulation or SimulationSpec()
        if simulation.tokenizer is not None and simulation.tokenizer not in self.models:
            errors.append(f"{where}.simulation.tokenizer: unknown model {simulation.tokenizer!r}")
        return errors
