"""`python -m router.train`: train the DQN router in simulation.

Double DQN (`router.dqn`) on the routing environment (`router.env`): one step routes one
request, with a random rate each episode (`router.env.RandomRates`), request lengths from the
training distributions (`workloads.lengths`) and admission control on or off per episode. By
default the network reads a row of features per model (`router.action_features`: what sending
the request there would mean for its SLO, from the deployment's profile) through one small MLP
shared by the rows, and chooses only among the models expected to serve the request in time,
else the least-loaded replica's; `--layout flat` trains the layout of the policies before it
(every replica's load, the task, the request's lengths, into one MLP), whose actions are masked
only where admission control rules them out.

Every `--eval-every` steps the greedy network is validated on a grid of the training
distributions by rate under each admission rule (`router.evaluate.grid_reward`, workloads drawn
from their own seeds); the best of them, among those that keep to `--guard`, is saved to `--out`
(default router/trained/<deployment>.npz). Under `--logdir` (default results/router/<deployment>/):
each validated network (checkpoints/step-<N>.npz, which `--pick-best` validates again), the
newest training state with its replay buffer (checkpoints/state.pt, which `--resume` goes on
from), and the learning curve (learning-curve.json and .png).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch as th

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from router.action_features import IN_TIME, ActionFeatures
from router.dqn import DoubleDqn, Hyperparameters, ReplayBuffer
from router.env import RoutingEnv
from router.evaluate import grid_reward, guard_rewards, training_sampler, validation_reward
from router.features import Encoder, FeatureEncoder
from router.policies import TRAINED, DqnPolicy
from router.sim import Simulator
from router.stale import StaleSimulator
from workloads.lengths import TRAINING, Lengths, named

LAYOUTS = ("per-action", "flat")
HYPERPARAMETERS = {
    # A smaller network for the per-action layout: it sees each model's row alone, and the rows
    # carry what the flat network had to learn (validated: 64x64 against 256x256 on the grid).
    # Learning every 8 steps from 128 samples trains as well as every 4 from 64, in half the time.
    "per-action": Hyperparameters(gamma=0.95, net_arch=(64, 64), train_freq=8, batch_size=128),
    "flat": Hyperparameters(),
}
"""The defaults of each layout (`router.dqn.Hyperparameters`)."""


def make_env(deployment: Deployment, args: argparse.Namespace) -> RoutingEnv:
    return RoutingEnv(
        deployment,
        training_sampler(deployment, named(args.lengths), (args.min_rate, args.max_rate)),
        episode_requests=args.episode_requests,
        action="model" if args.layout == "per-action" else args.action,
        credit="request",
        simulator=stale_simulators(deployment, args) if args.stale_ms else None,
        admission_rules=args.admission_rules,
        encoder=encoder_of(deployment, args),
    )


def encoder_of(deployment: Deployment, args: argparse.Namespace) -> Encoder:
    if args.layout == "per-action":
        return ActionFeatures(deployment, in_time=args.in_time, loads=args.loads)
    return FeatureEncoder.for_deployment(deployment)


def stale_simulators(
    deployment: Deployment, args: argparse.Namespace, seed: int | None = None
) -> Callable[[], Simulator]:
    """Each episode's simulator: `args.routers` routers over the fleet, the one routing each
    request seeing the others' requests as of a snapshot whose age each episode draws from
    `args.stale_ms` (`router.stale`), as workers on several hosts would."""
    rng = random.Random(args.seed if seed is None else seed)
    intervals = [float(ms) / 1000 for ms in args.stale_ms.split(",")]

    def simulator() -> Simulator:
        return StaleSimulator.from_deployment(
            deployment, routers=args.routers, interval_s=rng.choice(intervals),
            seed=rng.randrange(2**31),
        )  # fmt: skip

    return simulator


class Trainer:
    """One training run's state: the environment, the agent, the replay buffer, the steps
    taken and the learning curve (every finished episode's mean reward per request, late
    credit included)."""

    def __init__(self, env: RoutingEnv, hyper: Hyperparameters, seed: int, total: int) -> None:
        self.env = env
        self.hyper = hyper
        self.total = total
        row = env.encoder.row if isinstance(env.encoder, ActionFeatures) else None
        actions = len(env.models) if env.action_kind == "model" else len(env.deployment.replicas)
        size = env.encoder.size
        self.agent = DoubleDqn(size, actions, hyper, seed, row)
        self.buffer = ReplayBuffer(hyper.buffer_size, size, actions)
        self.step = 0
        self.curve: list[tuple[int, float]] = []
        self._seed = seed
        self._episode = 0.0
        self._slots: dict[int, int] = {}
        self._obs: np.ndarray | None = None

    def run(self, until: int, tick: Callable[[], object] = lambda: None) -> None:
        """Take steps until `until`: act, store the transition, credit late rewards to the
        transitions of the steps that routed them, and learn every `train_freq` steps."""
        env, agent, buffer, hyper = self.env, self.agent, self.buffer, self.hyper
        if self._obs is None:
            self._obs, _ = env.reset(seed=self._seed + self.step)
        obs, mask = self._obs, env.action_mask()
        while self.step < until:
            action = agent.act(obs, mask, hyper.epsilon(self.step, self.total))
            routed = env.steps
            next_obs, reward, terminated, truncated, info = env.step(action)
            next_mask = env.action_mask() if not truncated else np.ones_like(mask)
            self._slots[routed] = buffer.add(obs, action, reward, next_obs, terminated, next_mask)
            self._episode += reward
            for at, late in info.get("late_credit", ()):
                buffer.credit(self._slots.pop(at), late)
                self._episode += late
            self.step += 1
            if self.step > hyper.learning_starts and self.step % hyper.train_freq == 0:
                agent.update(buffer)
            if truncated:  # the episode's requests have all ended and been credited
                # Per request that arrived: those shed at the door earned 0 and took no step.
                self.curve.append((self.step, self._episode / env.episode_requests))
                self._episode, self._slots = 0.0, {}
                obs, _ = env.reset()
                mask = env.action_mask()
            else:
                obs, mask = next_obs, next_mask
            tick()
        self._obs = obs

    def save(self, path: Path) -> None:
        """The state to go on from (`resume`): networks, optimiser, buffer, counters."""
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = self.buffer
        th.save(
            {
                "q": self.agent.q.state_dict(),
                "target": self.agent.target.state_dict(),
                "optimizer": self.agent.optimizer.state_dict(),
                "updates": self.agent.updates,
                "rng": self.agent.rng.bit_generator.state,
                "step": self.step,
                "curve": self.curve,
                "buffer": {k: getattr(buffer, k) for k in BUFFER_FIELDS},
            },
            path,
        )

    def resume(self, path: Path) -> None:
        """Go on from a saved state. The requests in flight when it was saved never report
        back: their few hundred transitions keep what was credited by then."""
        state = th.load(path, weights_only=False)
        self.agent.q.load_state_dict(state["q"])
        self.agent.target.load_state_dict(state["target"])
        self.agent.optimizer.load_state_dict(state["optimizer"])
        self.agent.updates = state["updates"]
        self.agent.rng.bit_generator.state = state["rng"]
        self.step, self.curve = state["step"], [tuple(p) for p in state["curve"]]
        for key, value in state["buffer"].items():
            setattr(self.buffer, key, value)


class Validation:
    """The greedy policies seen so far, each with its mean reward on fixed validation workloads,
    and the best of them: what training ships. A DQN's greedy policy can get worse with more
    training, so the last network is not necessarily the one to route with."""

    def __init__(
        self,
        deployment: Deployment,
        simulators: Callable[[], Callable[[], Simulator]] | None = None,
        lengths: Sequence[Lengths] = (),
        admission_rules: Sequence[Literal["deadline", "none"]] = (),
        guard: DqnPolicy | None = None,
    ) -> None:
        """`simulators()`: each validation's simulators, the same sequence every time (default:
        the deployment's, with exact views); `lengths`: the request lengths training draws
        from, validated on a grid of them by rate (`router.evaluate.grid_reward`; none: six
        episodes of the lengths of Chuppala (2024) at random rates); `admission_rules`: those
        training draws from, the validation run under each (none: the deployment's); `guard`: a
        policy the one picked must not fall behind on the thesis's workload by more than
        GUARD_MARGIN, where any checkpoint keeps to that (`guard_rewards`)."""
        self.deployment = deployment
        self.simulators = simulators
        self.lengths = tuple(lengths)
        self.admission_rules = tuple(admission_rules)
        self.guard = guard
        self._guarded = guard_rewards(deployment, guard) if guard is not None else None
        self.evaluations: list[tuple[int, float]] = []
        self.margins: list[tuple[int, float]] = []
        """Per validated step, its worst margin over the guard on the thesis's workload."""
        self.best: tuple[float, int, DqnPolicy] | None = None
        self._best_any: tuple[float, int, DqnPolicy] | None = None

    def record(self, step: int, policy: DqnPolicy) -> float:
        simulator = self.simulators() if self.simulators is not None else None
        deployments = [self.deployment.with_admission(r) for r in self.admission_rules]
        rewards = []
        for deployment in deployments or [self.deployment]:
            if self.lengths:
                rewards.append(grid_reward(deployment, policy, self.lengths, simulator=simulator))
            else:
                rewards.append(validation_reward(deployment, policy, simulator=simulator))
        reward = float(np.mean(rewards))
        self.evaluations.append((step, reward))
        if self._best_any is None or reward > self._best_any[0]:
            self._best_any = (reward, step, policy)
        kept = True
        if self._guarded is not None:
            margin = float(np.min(guard_rewards(self.deployment, policy) - self._guarded))
            self.margins.append((step, round(margin, 4)))
            kept = margin >= -GUARD_MARGIN
        if kept and (self.best is None or reward > self.best[0]):
            self.best = (reward, step, policy)
        return reward

    def save(self, path: Path, meta: dict[str, Any]) -> DqnPolicy:
        """Write the best policy, with `meta` and the validation record, to `path`."""
        if self.best is None:
            assert self._best_any is not None, "nothing was validated"
            print("warning: no checkpoint keeps to the guard; the best is picked regardless",
                  file=sys.stderr)  # fmt: skip
            self.best = self._best_any
        reward, step, best = self.best
        meta = meta | {
            "selected_step": step,
            "validation_reward": round(reward, 4),
            "validation": self.evaluations,
        }
        if self.guard is not None:
            guard = self.guard.meta
            meta["guard"] = {"margin": GUARD_MARGIN, "worst_margins": self.margins,
                             "policy": guard.get("trained_by") or guard.get("command")}  # fmt: skip
        policy = DqnPolicy(best.layers, best.meta | meta)
        path.parent.mkdir(parents=True, exist_ok=True)
        policy.save(path)
        return policy


def export(agent: DoubleDqn, env: RoutingEnv, meta: dict[str, Any]) -> DqnPolicy:
    """The online network as numpy layers, with the layout it reads and what its actions mean."""
    deployment, encoder = env.deployment, env.encoder
    layout: dict[str, Any] = {
        "action": env.action_kind,
        "models": deployment.models,
        "replicas": [r.name for r in deployment.replicas],
        "masked": True,
    }
    if isinstance(encoder, ActionFeatures):
        layout |= encoder.describe() | {"tasks": encoder.tasks, "qos_classes": encoder.classes,
                                        "context": encoder.context}  # fmt: skip
    else:
        assert isinstance(encoder, FeatureEncoder)
        layout |= {
            "replicas": encoder.replicas,
            "tasks": list(encoder.tasks),
            "qos_classes": list(encoder.qos_classes),
            "batch_scale": encoder.batch_scale,
            "rate_scale": encoder.rate_scale,
        }
        if encoder.reads_lengths:
            layout |= {"token_scale": encoder.token_scale, "context": encoder.context}
        if encoder.deadlines is not None:
            layout |= {"path_deadlines": encoder.deadlines, "tpot_s": encoder.tpot_s}
    policy = DqnPolicy(agent.layers(), meta | layout)
    policy.bind(deployment)
    return policy


def start_from(agent: DoubleDqn, policy: DqnPolicy, env: RoutingEnv, only_new: bool) -> None:
    """Put a trained policy's network into the agent (online and target): each of the policy's
    inputs goes to the same input of the new layout (`inputs_of`), and the inputs the policy
    lacks get zero weights, so that the agent starts out routing exactly as it does. This is
    how the network-aware router starts from the network-blind one.

    With `only_new`, training then changes only the weights of those new inputs: the rest of the
    network stays the policy's. A perfect path encodes as zeros in either layout, so on such a
    path the agent routes as the policy does, however long it trains."""
    policy.check_fits(env.deployment)
    policy.bind(env.deployment)
    linears = agent.q.linears()
    shapes = [tuple(m.weight.shape) for m in linears]
    if len(linears) != len(policy.layers) or any(
        w.shape[0] != shape[0] or (i > 0 and w.shape[1] != shape[1])
        for i, ((w, _), shape) in enumerate(zip(policy.layers, shapes, strict=True))
    ):
        raise SystemExit(f"--init-from: its layers {[w.shape for w, _ in policy.layers]} do not "
                         f"fit the network's {shapes}")  # fmt: skip
    known = inputs_of(policy.encoder, env.encoder)
    with th.no_grad():
        for i, (linear, (w, b)) in enumerate(zip(linears, policy.layers, strict=True)):
            linear.weight.zero_()
            if i == 0:
                linear.weight[:, known] = th.from_numpy(w)
            else:
                linear.weight.copy_(th.from_numpy(w))
            linear.bias.copy_(th.from_numpy(b))
    agent.target.load_state_dict(agent.q.state_dict())
    if not only_new:
        return
    for parameter in agent.q.parameters():
        parameter.requires_grad_(parameter is linears[0].weight)

    def new_inputs_only(grad: th.Tensor) -> th.Tensor:
        grad = grad.clone()
        grad[:, known] = 0  # Adam moves a weight whose gradients are all zero not at all
        return grad

    linears[0].weight.register_hook(new_inputs_only)


def inputs_of(old: Encoder, new: Encoder) -> list[int]:
    """Where each input of layout `old` is in layout `new` (a row's, for per-action layouts):
    what comes first in both, then the lengths and the path, each where `new` has it.
    SystemExit where `new` lacks a block `old` has, or the two differ in what comes first."""
    if isinstance(old, ActionFeatures) and isinstance(new, ActionFeatures):
        # The path, where the new one reads it, is the end of its row.
        if old.row > new.row or (old.paths and not new.paths) or old.shared_at != new.shared_at:
            raise SystemExit(f"--init-from: its rows ({old.row}) are not a part of the "
                             f"deployment's layout ({new.row})")  # fmt: skip
        return list(range(old.row))
    if not (isinstance(old, FeatureEncoder) and isinstance(new, FeatureEncoder)):
        raise SystemExit("--init-from: a flat policy cannot start a per-action one, or back")
    base = old.lengths_at
    if (
        base != new.lengths_at
        or (old.reads_lengths and not new.reads_lengths)
        or (old.deadlines is not None and new.deadlines is None)
    ):
        raise SystemExit(f"--init-from: its inputs ({old.size}) are not a part of the "
                         f"deployment's layout ({new.size})")  # fmt: skip
    where = list(range(base))
    if old.reads_lengths:
        where += range(new.lengths_at, new.lengths_at + 3)
    if old.deadlines is not None:
        where += range(new.path_at, new.path_at + 4)
    return where


def plot_curve(
    curve: list[tuple[int, float]],
    path: Path,
    title: str,
    evaluations: list[tuple[int, float]] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if curve:
        steps, rewards = zip(*curve, strict=True)
        ax.plot(steps, rewards, ".", ms=2, alpha=0.3, label="episode")
        k = max(1, len(rewards) // 50)
        smooth = np.convolve(rewards, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, label=f"mean of {k}")
    if evaluations:
        ax.plot(*zip(*evaluations, strict=True), "ko-", label="greedy, validation workloads")
    ax.set(xlabel="training step (requests routed)", ylabel="mean reward per request", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hyperparameters(args: argparse.Namespace) -> Hyperparameters:
    """The layout's defaults, with what the command line sets."""
    hyper = HYPERPARAMETERS[args.layout]
    if args.gamma is not None:
        hyper = replace(hyper, gamma=args.gamma)
    if args.net_arch is not None:
        hyper = replace(hyper, net_arch=args.net_arch)
    if args.train_freq is not None:
        hyper = replace(hyper, train_freq=args.train_freq)
    if args.batch_size is not None:
        hyper = replace(hyper, batch_size=args.batch_size)
    return replace(hyper, learning_starts=args.learning_starts)


def train(args: argparse.Namespace, deployment: Deployment) -> DqnPolicy:
    from tqdm import tqdm

    th.set_num_threads(args.threads)
    args.logdir.mkdir(parents=True, exist_ok=True)
    checkpoints = args.logdir / "checkpoints"
    state = checkpoints / STATE
    if not args.resume or not (args.logdir / TRAINED_BY).exists():
        (args.logdir / TRAINED_BY).write_text(_command() + "\n")
    env = make_env(deployment, args)
    hyper = hyperparameters(args)
    trainer = Trainer(env, hyper, args.seed, args.steps)
    if args.resume and state.exists():
        trainer.resume(state)
        print(f"resuming from {state} at step {trainer.step}", file=sys.stderr)
    elif args.resume:
        print(f"no checkpoint in {args.logdir}; starting afresh", file=sys.stderr)
    elif args.init_from is not None:
        start_from(trainer.agent, DqnPolicy.load(args.init_from), env, args.only_new_inputs)
    validation = _validation(deployment, args)
    meta = _meta(args, deployment, hyper)
    start = time.monotonic()
    every = [n for n in (args.eval_every, args.checkpoint_every) if n]
    with tqdm(total=args.steps, initial=trainer.step, unit="step", smoothing=0.05,
              mininterval=1.0, disable=args.no_progress) as bar:  # fmt: skip
        while trainer.step < args.steps:
            stop = min([args.steps] + [(trainer.step // n + 1) * n for n in every])
            trainer.run(stop, lambda: bar.update(1))
            recent = [r for _, r in trainer.curve[-20:]]
            if recent:
                bar.set_postfix(reward=f"{np.mean(recent):.3f}", refresh=False)
            if args.eval_every and trainer.step % args.eval_every == 0:
                _validate(trainer, validation, checkpoints, meta, bar)
            if args.checkpoint_every and trainer.step % args.checkpoint_every == 0:
                trainer.save(state)
    if not validation.evaluations or validation.evaluations[-1][0] != trainer.step:
        _validate(trainer, validation, checkpoints, meta, None)  # the final network competes too
    (args.logdir / "learning-curve.json").write_text(json.dumps(trainer.curve))
    plot_curve(trainer.curve, args.logdir / "learning-curve.png",
               f"DQN router, {deployment.name}", validation.evaluations)  # fmt: skip
    meta |= {"steps": trainer.step, "train_seconds": round(time.monotonic() - start, 1)}
    return validation.save(args.out, meta)


def _validate(
    trainer: Trainer,
    validation: Validation,
    checkpoints: Path,
    meta: dict[str, Any],
    bar: Any | None,
) -> None:
    """Validate the network as it is now, and keep it (with what the run records of itself)."""
    policy = export(trainer.agent, trainer.env, meta | {"steps": trainer.step})
    checkpoints.mkdir(parents=True, exist_ok=True)
    policy.save(checkpoints / f"step-{trainer.step}.npz")
    reward = validation.record(trainer.step, policy)
    if bar is not None:
        bar.write(f"step {trainer.step}: validation reward {reward:.4f}")


def pick_checkpoint(args: argparse.Namespace, deployment: Deployment) -> DqnPolicy:
    """Validate every network a finished run kept and save the best: with another guard, say,
    or for a run with --eval-every 0."""
    found = sorted((args.logdir / "checkpoints").glob("step-*.npz"), key=_step)
    if not found:
        raise SystemExit(f"no checkpoints in {args.logdir / 'checkpoints'}")
    validation = _validation(deployment, args)
    for path in found:
        policy = DqnPolicy.load(path)
        policy.bind(deployment)
        reward = validation.record(_step(path), policy)
        print(f"step {_step(path):>9}: validation reward {reward:.4f}", file=sys.stderr)
    curve_file = args.logdir / "learning-curve.json"
    if curve_file.exists():
        curve = [tuple(p) for p in json.loads(curve_file.read_text())]
        plot_curve(curve, args.logdir / "learning-curve.png",
                   f"DQN router, {deployment.name}", validation.evaluations)  # fmt: skip
    meta = _meta(args, deployment, hyperparameters(args)) | {"steps": _step(found[-1])}
    return validation.save(args.out, meta)


def _step(path: Path) -> int:
    """The training step in a kept network's file name (step-<N>.npz)."""
    return int(path.stem.split("-")[-1])


def _validation(deployment: Deployment, args: argparse.Namespace) -> Validation:
    """What picks the network to ship, for a run and for its checkpoints afterwards alike."""
    guard = DqnPolicy.load(args.guard) if args.guard is not None else None
    return Validation(deployment, _validation_simulators(deployment, args), named(args.lengths),
                      args.admission_rules, guard)  # fmt: skip


def _validation_simulators(
    deployment: Deployment, args: argparse.Namespace
) -> Callable[[], Callable[[], Simulator]] | None:
    """Validation on the views training sees: stale ones, drawn afresh from one seed each time."""
    if not args.stale_ms:
        return None
    return lambda: stale_simulators(deployment, args, seed=VALIDATION_STALE_SEED)


VALIDATION_STALE_SEED = 20_261_128
GUARD_MARGIN = 0.005
STATE = "state.pt"
BUFFER_FIELDS = ("obs", "next_obs", "action", "reward", "done", "next_mask", "pos", "full")
TRAINED_BY = "command.txt"


def _meta(
    args: argparse.Namespace, deployment: Deployment, hyper: Hyperparameters
) -> dict[str, Any]:
    """What a saved policy says about the run that made it."""
    return {
        "deployment": deployment.name,
        "path_mix": deployment.path_mix,
        "seed": args.seed,
        "stale_view": {"routers": args.routers, "staleness_ms": args.stale_ms}
        if args.stale_ms
        else None,
        "command": _command(),
        # The run that trained it, where the command picked among its checkpoints afterwards.
        "trained_by": _trained_by(args.logdir),
        # The rewards it learned from: a policy trained on another table is stale.
        "quality": deployment.quality,
        "quality_source": deployment.quality_source,
        "hyperparameters": asdict(hyper) | {"double_q": True, "layout": args.layout},
        # What it was trained on: the lengths it knows, and the load.
        "training": {
            "rates": [args.min_rate, args.max_rate],
            "classes": list(deployment.qos_classes),
            "context": deployment.max_model_len,
            "admission": args.admission_rules or [deployment.admission.rule],
            "lengths": {d.name: d.describe() for d in named(args.lengths)}
            or {"seed": "those of Chuppala (2024) (no --lengths)"},
        },
    }


def _command() -> str:
    return " ".join(["python -m router.train", *map(shlex.quote, sys.argv[1:])])


def _trained_by(logdir: Path) -> str:
    """The command of the training run whose logs are in `logdir` (`train` writes it there)."""
    written = logdir / TRAINED_BY
    return written.read_text().strip() if written.exists() else _command()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m router.train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_PATH, help="models.yaml path")
    parser.add_argument("--deployment", default="paper-4gpu", help="needs a latency profile")
    parser.add_argument(
        "--paths",
        metavar="MIX",
        help="train the network-aware router: clients on models.yaml's path mix MIX (default: "
        "the deployment's own mix, if it names one)",
    )
    parser.add_argument("--steps", type=int, default=1_200_000, help="total training steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=LAYOUTS, default="per-action",
                        help="what the network reads (see above; default per-action)")  # fmt: skip
    parser.add_argument("--action", choices=["model", "replica"], default="model",
                        help="the flat layout's actions (per-action: the models)")  # fmt: skip
    parser.add_argument("--gamma", type=float, help="discount (default: the layout's)")
    parser.add_argument(
        "--loads",
        action="store_true",
        help="per-action layout: every row also reads every replica's load and the task",
    )
    parser.add_argument(
        "--in-time",
        type=float,
        default=IN_TIME,
        help="per-action layout: the expected ratios at most which a model may be chosen",
    )
    parser.add_argument(
        "--net-arch",
        type=lambda text: tuple(int(v) for v in text.split(",")),
        help="hidden layers, e.g. 64,64 (default: the layout's)",
    )
    parser.add_argument(
        "--train-freq", type=int, help="steps between updates (default: per layout)"
    )
    parser.add_argument(
        "--batch-size", type=int, help="transitions an update (default: per layout)"
    )
    parser.add_argument("--episode-requests", type=int, default=1000)
    parser.add_argument(
        "--learning-starts",
        type=int,
        default=Hyperparameters().learning_starts,
        help="random steps before the first update",
    )
    parser.add_argument(
        "--stale-ms",
        metavar="LIST",
        help="train on stale views: --routers routers, each seeing the others' requests as of "
        "a snapshot refreshed every one of these ms, drawn per episode (e.g. 0,10,50,100,250)",
    )
    parser.add_argument("--routers", type=int, default=2, help="with --stale-ms")
    parser.add_argument(
        "--lengths",
        type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
        default=[d.name for d in TRAINING],
        metavar="NAMES",
        help="request length distributions, one drawn per episode (workloads.lengths; default: "
        f"{','.join(d.name for d in TRAINING)}); an empty string: those of Chuppala (2024) alone, "
        "as before",
    )
    parser.add_argument(
        "--admission-rules",
        type=lambda text: [r.strip() for r in text.split(",") if r.strip()],
        default=["deadline", "none"],
        metavar="RULES",
        help="admission control, one rule drawn per episode (default: deadline,none, so that "
        "the policy routes well with it and without); an empty string: the deployment's own",
    )
    parser.add_argument("--min-rate", type=float, default=0.25)
    parser.add_argument("--max-rate", type=float, default=48.0)
    parser.add_argument("--out", type=Path, help="default: router/trained/<deployment>.npz")
    parser.add_argument("--logdir", type=Path, help="default: results/router/<deployment>")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--init-from",
        type=Path,
        metavar="NPZ",
        help="start from a trained policy's network (the network-blind one, for --paths); "
        "inputs it lacks start at zero weight",
    )
    parser.add_argument(
        "--only-new-inputs",
        action="store_true",
        help="with --init-from: train only the weights of the inputs that policy lacks",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=100_000,
        help="steps between saves of the training state, for --resume (0: never)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--pick-best",
        action="store_true",
        help="train nothing: validate the networks a run in --logdir kept and save the best",
    )
    parser.add_argument(
        "--guard",
        type=Path,
        metavar="NPZ",
        help="pick the best validated network among those that do not fall behind "
        f"this policy by more than {GUARD_MARGIN} on the workload of Chuppala (2024) at any rate "
        "(router.evaluate.guard_rewards): the one a new policy replaces",
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=100_000,
        help="steps between validations; the best validated network is saved (0: the last)",
    )
    return parser


def main() -> int:
    parser = build_parser()
    args = parser.parse_args()
    try:
        deployment = load_deployment(args.config, args.deployment, args.paths)
    except ConfigError as exc:
        parser.error(str(exc))
    if deployment.profile is None:
        parser.error(f"deployment {deployment.name!r} names no latency profile to simulate")
    try:
        named(args.lengths)
    except ValueError as exc:
        parser.error(str(exc))
    if unknown := set(args.admission_rules) - {"deadline", "none"}:
        parser.error(f"--admission-rules: unknown {', '.join(sorted(unknown))} (deadline, none)")
    if args.steps <= 0 or args.episode_requests <= 0 or not 0 < args.min_rate <= args.max_rate:
        parser.error("--steps, --episode-requests > 0 and 0 < --min-rate <= --max-rate, please")
    if args.layout == "per-action" and args.action != "model":
        parser.error("--action replica: the per-action layout's actions are the models")
    name = deployment.name + ("-net" if deployment.paths is not None else "")
    args.out = args.out or TRAINED / f"{name}.npz"
    args.logdir = args.logdir or Path("results") / "router" / name
    policy = pick_checkpoint(args, deployment) if args.pick_best else train(args, deployment)
    print(
        f"wrote {args.out} (step {policy.meta['selected_step']} of {policy.meta['steps']}, "
        f"validation reward {policy.meta['validation_reward']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
