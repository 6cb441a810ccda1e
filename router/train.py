"""`python -m router.train`: train the DQN router in simulation (seed 004 §5.1).

Double DQN, a 2 x 256 MLP, learning rate 1e-4, discount 0.99, a target network copied every 500
steps, epsilon-greedy exploration; 1.2 M steps by default, on the deployment's latency profile
with a random rate each episode (`router.env.RandomRates`).

Writes, under `--logdir` (default results/router/<deployment>/): TensorBoard logs, checkpoints
with the replay buffer (so `--resume` continues where a run stopped), and the learning curve
(learning-curve.json and .png). The trained network goes to `--out` (default
router/policies/<deployment>.npz) as numpy arrays, the form the gateway routes with.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch as th
import torch.nn.functional as F
from stable_baselines3 import DQN
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback

from config import DEFAULT_PATH, ConfigError, Deployment, load_deployment
from router.env import RoutingEnv
from router.evaluate import grid_reward, guard_rewards, training_sampler, validation_reward
from router.features import FeatureEncoder
from router.policies import DqnPolicy
from router.sim import Simulator
from router.stale import StaleSimulator
from workloads.lengths import TRAINING, Lengths, named

HYPERPARAMETERS: dict[str, Any] = {
    "learning_rate": 1e-4,
    "gamma": 0.99,
    "target_update_interval": 500,
    "policy_kwargs": {"net_arch": [256, 256]},
    "buffer_size": 200_000,
    "learning_starts": 10_000,
    "batch_size": 64,
    "train_freq": 4,
    "exploration_fraction": 0.1,
    "exploration_final_eps": 0.02,
}


class DoubleDQN(DQN):
    """DQN with the Double Q-learning target (van Hasselt et al., 2016): the online network picks
    the next action and the target network values it.

    SB3's DQN takes the max of the target network, which over-estimates; SB3 has no flag for
    this, so `train` is SB3's own with that one line changed (marked)."""

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env)  # type: ignore[union-attr]
            discounts = data.discounts if data.discounts is not None else self.gamma
            with th.no_grad():
                # Double Q: argmax from the online network, value from the target network.
                best = self.q_net(data.next_observations).argmax(dim=1, keepdim=True)
                next_q = th.gather(self.q_net_target(data.next_observations), 1, best)
                target = data.rewards + (1 - data.dones) * discounts * next_q
            current = th.gather(self.q_net(data.observations), 1, data.actions.long())
            loss = F.smooth_l1_loss(current, target)
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))


class LateCredit(BaseCallback):
    """Adds each late reward to the stored transition of the step that routed its request
    (`RoutingEnv(credit="request")`).

    Every step's transition goes into the replay buffer, in order, right after this callback
    runs; so the step `at` of the environment sits at (position at start + at) modulo the size.
    A reward for the current step comes as the step's own reward, never late, so the transition
    it belongs to is always stored before its credit arrives."""

    def __init__(self, env: RoutingEnv) -> None:
        super().__init__()
        self.env = env

    def _on_training_start(self) -> None:
        buffer = self.model.replay_buffer  # type: ignore[attr-defined]
        # One environment, and credit never older than the buffer: otherwise the mapping breaks.
        assert self.model.n_envs == 1 and self.env.episode_requests < buffer.buffer_size
        self.origin = buffer.pos - self.env.steps

    def _on_step(self) -> bool:
        buffer = self.model.replay_buffer  # type: ignore[attr-defined]
        for info in self.locals.get("infos", []):
            for at, reward in info.get("late_credit", ()):
                buffer.rewards[(self.origin + at) % buffer.buffer_size, 0] += reward
        return True


class Progress(BaseCallback):
    """A tqdm bar showing the mean reward per request of recent episodes, and the learning curve
    (every finished episode's mean reward per request, late credit included) for the PNG."""

    def __init__(self, total: int, episode_requests: int, show: bool = True) -> None:
        super().__init__()
        self.total = total
        self.show = show
        self.episode_requests = episode_requests
        self.curve: list[tuple[int, float]] = []
        self._episode = 0.0

    def _on_training_start(self) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total,
            initial=self.num_timesteps,
            unit="step",
            smoothing=0.05,
            mininterval=1.0,
            disable=not self.show,
        )

    def _on_step(self) -> bool:
        self.bar.update(1)
        for info, reward, done in zip(
            self.locals["infos"], self.locals["rewards"], self.locals["dones"], strict=True
        ):
            self._episode += float(reward) + sum(r for _, r in info.get("late_credit", ()))
            if done:
                per_request, self._episode = self._episode / self.episode_requests, 0.0
                self.curve.append((self.num_timesteps, per_request))
                self.logger.record("rollout/reward_per_request", per_request)
                recent = np.mean([r for _, r in self.curve[-20:]])
                self.bar.set_postfix(reward=f"{recent:.3f}", refresh=False)
        return True

    def _on_training_end(self) -> None:
        self.bar.close()


def _step(path: Path) -> int:
    """The training step in an SB3 checkpoint's file name (dqn_<step>_steps.zip, or .pkl)."""
    return int(path.stem.split("_")[-2])


def _checkpoints(directory: Path, pattern: str = "dqn_*_steps.zip") -> list[Path]:
    """Checkpoint files in `directory`, oldest first."""
    return sorted(directory.glob(pattern), key=_step)


class Checkpoint(CheckpointCallback):
    """SB3's checkpoints, keeping only the newest replay buffer (each is tens of megabytes)."""

    def _on_step(self) -> bool:
        result = super()._on_step()
        for old in _checkpoints(Path(self.save_path), "dqn_replay_buffer_*_steps.pkl")[:-1]:
            old.unlink()
        return result


class Validation:
    """The greedy policies seen so far, each with its mean reward on fixed validation workloads
    (`router.evaluate.validation_reward`), and the best of them: what training ships, as SB3's
    EvalCallback keeps a best model. DQN's greedy policy can get worse with more training (it
    did here: see the README), so the last network is not necessarily the one to route with."""

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
        episodes of seed 004's lengths at random rates); `admission_rules`: those training
        draws from, the validation run under each (none: the deployment's); `guard`: a policy
        the one picked must not fall behind on seed 004's workload by more than GUARD_MARGIN,
        where any checkpoint keeps to that (`guard_rewards`)."""
        self.deployment = deployment
        self.simulators = simulators
        self.lengths = tuple(lengths)
        self.admission_rules = tuple(admission_rules)
        self.guard = guard
        self._guarded = guard_rewards(deployment, guard) if guard is not None else None
        self.evaluations: list[tuple[int, float]] = []
        self.margins: list[tuple[int, float]] = []
        """Per validated step, its worst margin over the guard on seed 004's workload."""
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


class BestPolicy(BaseCallback):
    """Validates the greedy policy every `every` steps."""

    def __init__(self, validation: Validation, env: RoutingEnv, every: int) -> None:
        super().__init__()
        self.validation, self.env, self.every = validation, env, every

    def _on_step(self) -> bool:
        if self.every and self.num_timesteps % self.every == 0:
            self.evaluate()
        return True

    def evaluate(self) -> None:
        policy = export(self.model, self.validation.deployment, self.env, {})  # type: ignore[arg-type]
        reward = self.validation.record(self.num_timesteps, policy)
        self.logger.record("eval/validation_reward", reward)


def start_from(model: DQN, policy: DqnPolicy, deployment: Deployment, only_new: bool) -> None:
    """Put a trained policy's network into `model` (online and target): each of the policy's
    inputs goes to the same input of the deployment's layout (`inputs_of`), and the inputs the
    policy lacks get zero weights, so that the model starts out routing exactly as it does. This
    is how the network-aware router starts from the network-blind one, and a router that reads
    lengths from one that does not.

    With `only_new`, training then changes only the weights of those new inputs: the rest of the
    network stays the policy's. The network-aware layout encodes a perfect path as zeros
    (`router.features`), so on such a path the model routes as the policy does, however long it
    trains: knowing the network costs nothing where it does not matter."""
    policy.check_fits(deployment)
    linears = [m for m in model.q_net.q_net if isinstance(m, th.nn.Linear)]
    shapes = [tuple(m.weight.shape) for m in linears]
    if len(linears) != len(policy.layers) or any(
        w.shape[0] != shape[0] or (i > 0 and w.shape[1] != shape[1])
        for i, ((w, _), shape) in enumerate(zip(policy.layers, shapes, strict=True))
    ):
        raise SystemExit(f"--init-from: its layers {[w.shape for w, _ in policy.layers]} do not "
                         f"fit the model's {shapes}")  # fmt: skip
    known = inputs_of(policy.encoder, FeatureEncoder.for_deployment(deployment))
    with th.no_grad():
        for i, (linear, (w, b)) in enumerate(zip(linears, policy.layers, strict=True)):
            linear.weight.zero_()
            if i == 0:
                linear.weight[:, known] = th.from_numpy(w)
            else:
                linear.weight.copy_(th.from_numpy(w))
            linear.bias.copy_(th.from_numpy(b))
    model.q_net_target.load_state_dict(model.q_net.state_dict())
    if not only_new:
        return
    for parameter in model.q_net.parameters():
        parameter.requires_grad_(parameter is linears[0].weight)

    def new_inputs_only(grad: th.Tensor) -> th.Tensor:
        grad = grad.clone()
        grad[:, known] = 0  # Adam moves a weight whose gradients are all zero not at all
        return grad

    linears[0].weight.register_hook(new_inputs_only)


def inputs_of(old: FeatureEncoder, new: FeatureEncoder) -> list[int]:
    """Where each input of layout `old` is in layout `new`: the replicas, tasks, rate and classes
    first, then the lengths and the path, each where `new` has it. SystemExit where `new` lacks a
    block `old` has, or the two differ in what comes first."""
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


def make_env(deployment: Deployment, args: argparse.Namespace) -> RoutingEnv:
    return RoutingEnv(
        deployment,
        training_sampler(deployment, named(args.lengths), (args.min_rate, args.max_rate)),
        episode_requests=args.episode_requests,
        action=args.action,
        credit="request",
        simulator=stale_simulators(deployment, args) if args.stale_ms else None,
        admission_rules=args.admission_rules,
    )


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


def export(model: DQN, deployment: Deployment, env: RoutingEnv, meta: dict[str, Any]) -> DqnPolicy:
    """The online Q-network as numpy layers, with the layout it expects."""
    linears = [m for m in model.q_net.q_net if isinstance(m, th.nn.Linear)]
    layers = [(m.weight.detach().cpu().numpy(), m.bias.detach().cpu().numpy()) for m in linears]
    encoder = env.encoder
    return DqnPolicy(
        layers,
        meta
        | {
            "action": env.action_kind,
            "models": deployment.models,
            "replicas": encoder.replicas,
            "tasks": list(encoder.tasks),
            "qos_classes": list(encoder.qos_classes),
            "batch_scale": encoder.batch_scale,
            "rate_scale": encoder.rate_scale,
        }
        | (
            {"token_scale": encoder.token_scale, "context": encoder.context}
            if encoder.reads_lengths
            else {}
        )
        | (
            {"path_deadlines": encoder.deadlines, "tpot_s": encoder.tpot_s}
            if encoder.deadlines is not None
            else {}
        ),
    )


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


def train(args: argparse.Namespace, deployment: Deployment) -> DqnPolicy:
    th.set_num_threads(args.threads)
    args.logdir.mkdir(parents=True, exist_ok=True)
    if not args.resume or not (args.logdir / TRAINED_BY).exists():
        (args.logdir / TRAINED_BY).write_text(_command() + "\n")
    env = make_env(deployment, args)
    found = _checkpoints(args.logdir / "checkpoints") if args.resume else []
    checkpoint = found[-1] if found else None
    if checkpoint is not None:
        model = DoubleDQN.load(checkpoint, env=env, device="cpu")
        buffer = checkpoint.with_name(
            checkpoint.name.replace("dqn_", "dqn_replay_buffer_").replace(".zip", ".pkl")
        )
        if buffer.exists():
            model.load_replay_buffer(buffer)
        else:
            print(f"warning: no {buffer.name}; the replay buffer starts empty", file=sys.stderr)
        # The requests in flight at the checkpoint never report back: their few hundred
        # transitions keep a reward of 0, out of a buffer of 200,000.
        print(f"resuming from {checkpoint} at step {model.num_timesteps}", file=sys.stderr)
    hyperparameters = HYPERPARAMETERS | {"learning_starts": args.learning_starts}
    if checkpoint is None:
        if args.resume:
            print(f"no checkpoint in {args.logdir}; starting afresh", file=sys.stderr)
        model = DoubleDQN(
            "MlpPolicy",
            env,
            seed=args.seed,
            device="cpu",
            tensorboard_log=str(args.logdir / "tensorboard"),
            **hyperparameters,
        )
        if args.init_from is not None:
            start_from(model, DqnPolicy.load(args.init_from), deployment, args.only_new_inputs)
    curve_file = args.logdir / "learning-curve.json"
    progress = Progress(args.steps, args.episode_requests, show=not args.no_progress)
    if checkpoint is not None and curve_file.exists():
        progress.curve = [tuple(p) for p in json.loads(curve_file.read_text())]
    validation = _validation(deployment, args)
    best = BestPolicy(validation, env, args.eval_every)
    callbacks: list[BaseCallback] = [LateCredit(env), progress, best]
    if args.checkpoint_every:
        callbacks.append(
            Checkpoint(
                args.checkpoint_every,
                str(args.logdir / "checkpoints"),
                name_prefix="dqn",
                save_replay_buffer=True,
            )
        )
    start = time.monotonic()
    model.learn(
        total_timesteps=max(0, args.steps - model.num_timesteps),
        callback=callbacks,
        reset_num_timesteps=checkpoint is None,
        tb_log_name="dqn",
    )
    if not validation.evaluations or validation.evaluations[-1][0] != model.num_timesteps:
        best.evaluate()  # the final network competes too
    curve_file.write_text(json.dumps(progress.curve))
    plot_curve(progress.curve, args.logdir / "learning-curve.png",
               f"DQN router, {deployment.name}", validation.evaluations)  # fmt: skip
    # A resumed model keeps its own learning_starts.
    meta = _meta(args, deployment, model.num_timesteps, model.learning_starts)
    meta["train_seconds"] = round(time.monotonic() - start, 1)
    return validation.save(args.out, meta)


def pick_checkpoint(args: argparse.Namespace, deployment: Deployment) -> DqnPolicy:
    """Validate every checkpoint of a finished run and save the best: for a run made before
    training validated its own networks, or with --eval-every 0."""
    env = make_env(deployment, args)
    found = _checkpoints(args.logdir / "checkpoints")
    if not found:
        raise SystemExit(f"no checkpoints in {args.logdir / 'checkpoints'}")
    validation = _validation(deployment, args)
    for path in found:
        policy = export(DoubleDQN.load(path, device="cpu"), deployment, env, {})
        reward = validation.record(_step(path), policy)
        print(f"step {_step(path):>9}: validation reward {reward:.4f}", file=sys.stderr)
    curve_file = args.logdir / "learning-curve.json"
    if curve_file.exists():
        curve = [tuple(p) for p in json.loads(curve_file.read_text())]
        plot_curve(curve, args.logdir / "learning-curve.png",
                   f"DQN router, {deployment.name}", validation.evaluations)  # fmt: skip
    return validation.save(
        args.out, _meta(args, deployment, _step(found[-1]), args.learning_starts)
    )


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


def _meta(
    args: argparse.Namespace, deployment: Deployment, steps: int, learning_starts: int
) -> dict[str, Any]:
    """What a saved policy says about the run that made it."""
    return {
        "deployment": deployment.name,
        "path_mix": deployment.path_mix,
        "steps": int(steps),
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
        "hyperparameters": _hyperparameters(HYPERPARAMETERS | {"learning_starts": learning_starts}),
        # What it was trained on: the lengths it knows, and the load.
        "training": {
            "rates": [args.min_rate, args.max_rate],
            "classes": list(deployment.qos_classes),
            "context": deployment.max_model_len,
            "admission": args.admission_rules or [deployment.admission.rule],
            "lengths": {d.name: d.describe() for d in named(args.lengths)}
            or {"seed": "seed 004's (no --lengths)"},
        },
    }


def _command() -> str:
    return " ".join(["python -m router.train", *map(shlex.quote, sys.argv[1:])])


def _trained_by(logdir: Path) -> str:
    """The command of the training run whose logs are in `logdir` (`train` writes it there)."""
    written = logdir / TRAINED_BY
    return written.read_text().strip() if written.exists() else _command()


TRAINED_BY = "command.txt"


def _hyperparameters(hyperparameters: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in hyperparameters.items() if k != "policy_kwargs"} | {
        "net_arch": hyperparameters["policy_kwargs"]["net_arch"],
        "double_q": True,
    }


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
    parser.add_argument("--action", choices=["model", "replica"], default="model")
    parser.add_argument("--episode-requests", type=int, default=1000)
    parser.add_argument(
        "--learning-starts",
        type=int,
        default=HYPERPARAMETERS["learning_starts"],
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
        f"{','.join(d.name for d in TRAINING)}); an empty string: seed 004's alone, as before",
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
    parser.add_argument("--out", type=Path, help="default: router/policies/<deployment>.npz")
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
    parser.add_argument("--checkpoint-every", type=int, default=100_000, help="0: never")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--pick-best",
        action="store_true",
        help="train nothing: validate the checkpoints in --logdir and save the best to --out",
    )
    parser.add_argument(
        "--guard",
        type=Path,
        metavar="NPZ",
        help="pick the best validated network among those that do not fall behind "
        f"this policy by more than {GUARD_MARGIN} on seed 004's workload at any rate "
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
    package = Path(__file__).resolve().parent
    name = deployment.name + ("-net" if deployment.paths is not None else "")
    args.out = args.out or package / "policies" / f"{name}.npz"
    args.logdir = args.logdir or Path("results") / "router" / name
    policy = pick_checkpoint(args, deployment) if args.pick_best else train(args, deployment)
    print(
        f"wrote {args.out} (step {policy.meta['selected_step']} of {policy.meta['steps']}, "
        f"validation reward {policy.meta['validation_reward']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
