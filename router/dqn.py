"""Double DQN for the router, lean: the network, the replay buffer and one update, in torch and
numpy, with the actions admission control rules out masked.

Why not stable-baselines3's DQN, which trained the router before: profiled here, its loop spent
about 1 ms a step around the simulator (a torch forward and `set_training_mode` per action, the
vectorised-env and monitor wrappers, the logger) and 3 ms an update, where this spends 20 us
an action (numpy on the network's own weights) and about 1 ms an update. The algorithm is the
same: Double Q-learning's target (van Hasselt et al., 2016), a Huber loss, gradients clipped at
a norm of 10, Adam, a target network copied every `target_update` steps, epsilon-greedy
exploration decaying linearly, an MLP of `net_arch`. What it adds is masks: an action that
admission control rules out (no replica of that model may take the request) is never chosen,
in acting or in the next state's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch as th
import torch.nn.functional as F

from router.policies import q_values


@dataclass(frozen=True)
class Hyperparameters:
    learning_rate: float = 1e-4
    gamma: float = 0.99
    target_update: int = 500
    net_arch: tuple[int, ...] = (256, 256)
    buffer_size: int = 200_000
    learning_starts: int = 10_000
    batch_size: int = 64
    train_freq: int = 4
    exploration_fraction: float = 0.1
    exploration_initial: float = 1.0
    exploration_final: float = 0.02
    max_grad_norm: float = 10.0
    horizon_s: float | None = None
    """Discount by time instead of by step: a step's discount is exp(-dt / horizon_s), dt the
    time to the next request. What a request costs the ones after it is what arrives while it
    holds its replica: at 32 req/s a step's discount of 0.95 weighs the request that comes 3 s
    later (its slot's worth) by 0.6%, at 1 req/s the one 3 s later by 86%."""
    n_step: int = 1
    """Steps of rewards before the bootstrapped value: a request's effect on the next few
    requests reaches its value directly, not through an estimate."""
    centred: bool = False
    """Learn from rewards less their running mean per request (Naik et al., "Reward
    Centering", 2024): every request, routed or shed, costs the mean, so that the values
    differ by what a decision changes, not by the ~100 that discounting sums the mean up to.
    Off by default: on the validation grid it trained worse (docs/router.md, "Training")."""

    def epsilon(self, step: int, total: int) -> float:
        """Exploration at `step` of `total`: from initial to final over the first fraction."""
        progress = min(1.0, step / max(1.0, self.exploration_fraction * total))
        return self.exploration_initial + progress * (
            self.exploration_final - self.exploration_initial
        )


def mlp(inputs: int, outputs: int, arch: tuple[int, ...]) -> th.nn.Sequential:
    layers: list[th.nn.Module] = []
    for width in arch:
        layers += [th.nn.Linear(inputs, width), th.nn.ReLU()]
        inputs = width
    layers.append(th.nn.Linear(inputs, outputs))
    return th.nn.Sequential(*layers)


class QNetwork(th.nn.Module):
    """Q-values of every action from an observation. Flat: one MLP from the whole observation
    to a value per action. Per action (`row`): the observation is a row of features per action
    (`router.action_features`), and one MLP maps each row to its action's value."""

    def __init__(self, obs_size: int, actions: int, arch: tuple[int, ...], row: int | None) -> None:
        super().__init__()
        self.actions, self.row = actions, row
        self.mlp = mlp(row, 1, arch) if row is not None else mlp(obs_size, actions, arch)

    def forward(self, obs: th.Tensor) -> th.Tensor:
        if self.row is None:
            return self.mlp(obs)
        n = obs.shape[0]
        return self.mlp(obs.view(n * self.actions, self.row)).view(n, self.actions)

    def linears(self) -> list[th.nn.Linear]:
        return [m for m in self.mlp if isinstance(m, th.nn.Linear)]


@dataclass
class ReplayBuffer:
    """The last `size` transitions, each with the mask of its next state."""

    size: int
    obs_size: int
    actions: int
    pos: int = 0
    full: bool = False
    obs: np.ndarray = field(init=False)
    next_obs: np.ndarray = field(init=False)
    action: np.ndarray = field(init=False)
    reward: np.ndarray = field(init=False)
    done: np.ndarray = field(init=False)
    next_mask: np.ndarray = field(init=False)
    last: np.ndarray = field(init=False)
    """Whether a transition is its episode's last (where n-step returns stop)."""
    discount: np.ndarray = field(init=False)
    """Each transition's discount of the next state's value."""

    def __post_init__(self) -> None:
        self.obs = np.zeros((self.size, self.obs_size), np.float32)
        self.next_obs = np.zeros((self.size, self.obs_size), np.float32)
        self.action = np.zeros(self.size, np.int64)
        self.reward = np.zeros(self.size, np.float32)
        self.done = np.zeros(self.size, np.float32)
        self.next_mask = np.ones((self.size, self.actions), bool)
        self.last = np.zeros(self.size, bool)
        self.discount = np.ones(self.size, np.float32)

    def add(
        self,
        obs: np.ndarray,
        action: int,
        reward: float,
        next_obs: np.ndarray,
        done: bool,
        next_mask: np.ndarray,
        last: bool = False,
        discount: float = 1.0,
    ) -> int:
        """Store a transition; its slot, for rewards that come later (`credit`)."""
        slot = self.pos
        self.discount[slot] = discount
        self.obs[slot], self.next_obs[slot] = obs, next_obs
        self.action[slot], self.reward[slot], self.done[slot] = action, reward, done
        self.next_mask[slot], self.last[slot] = next_mask, last or done
        self.pos = (slot + 1) % self.size
        self.full = self.full or self.pos == 0
        return slot

    def credit(self, slot: int, reward: float) -> None:
        self.reward[slot] += reward

    def __len__(self) -> int:
        return self.size if self.full else self.pos

    def sample(self, n: int, rng: np.random.Generator, ahead: int = 1) -> np.ndarray:
        """`n` slots, each with `ahead` - 1 transitions stored after it."""
        stored = len(self) - (ahead - 1)
        return (self.pos - 1 - (ahead - 1) - rng.integers(0, stored, size=n)) % self.size

    def returns(self, idx: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each slot: the discounted rewards of up to `steps` transitions from it, stopping
        at its episode's last; the slot whose next state bootstraps; and the discount left."""
        total = np.zeros(len(idx), np.float32)
        discount = np.ones(len(idx), np.float32)
        alive = np.ones(len(idx), bool)
        end = idx.copy()
        for j in range(steps):
            k = (idx + j) % self.size
            total += np.where(alive, discount * self.reward[k], 0.0)
            end = np.where(alive, k, end)
            discount = np.where(alive, discount * self.discount[k], discount)
            alive &= ~self.last[k]
        return total, end, discount


class DoubleDqn:
    """The online and target networks, the optimiser, and acting and learning with masks."""

    def __init__(
        self,
        obs_size: int,
        actions: int,
        hyper: Hyperparameters,
        seed: int,
        row: int | None = None,
    ) -> None:
        """`row`: features per action, for a per-action layout (None: flat)."""
        th.manual_seed(seed)
        self.hyper = hyper
        self.actions = actions
        self.row = row
        self.q = QNetwork(obs_size, actions, hyper.net_arch, row)
        self.target = QNetwork(obs_size, actions, hyper.net_arch, row)
        self.target.load_state_dict(self.q.state_dict())
        self.optimizer = th.optim.Adam(self.q.parameters(), lr=hyper.learning_rate, foreach=True)
        self.rng = np.random.default_rng(seed)
        # The online network's weights as numpy arrays sharing its memory: acting reads the
        # weights as the optimiser leaves them, with no copy and no torch call.
        self._layers = [
            (m.weight.detach().numpy(), m.bias.detach().numpy()) for m in self.q.linears()
        ]
        self._forward = [(w.T, b) for w, b in self._layers]
        self.updates = 0

    def q_values(self, obs: np.ndarray) -> np.ndarray:
        return q_values(self._forward, obs, self.actions if self.row is not None else None)

    def act(self, obs: np.ndarray, mask: np.ndarray, epsilon: float) -> int:
        """Epsilon-greedy among the actions `mask` allows (all, if it allows none)."""
        allowed = np.flatnonzero(mask) if mask.any() else np.arange(self.actions)
        if self.rng.random() < epsilon:
            return int(allowed[self.rng.integers(len(allowed))])
        q = self.q_values(obs)
        return int(allowed[np.argmax(q[allowed])])

    def update(self, buffer: ReplayBuffer) -> float:
        """One gradient step on a sampled batch; the loss."""
        hyper = self.hyper
        idx = buffer.sample(hyper.batch_size, self.rng, hyper.n_step)
        if hyper.n_step > 1:
            rewards, end, discount = buffer.returns(idx, hyper.n_step)
        else:
            rewards, end, discount = buffer.reward[idx], idx, buffer.discount[idx]
        obs = th.from_numpy(buffer.obs[idx])
        next_obs = th.from_numpy(buffer.next_obs[end])
        action = th.from_numpy(buffer.action[idx]).unsqueeze(1)
        reward = th.from_numpy(rewards).unsqueeze(1)
        done = th.from_numpy(buffer.done[end]).unsqueeze(1)
        gamma = th.from_numpy(discount).unsqueeze(1)
        mask = th.from_numpy(buffer.next_mask[end])
        with th.no_grad():
            # Double Q: the online network picks the next action among those allowed, the
            # target network values it. A state that allows none (it cannot occur in a route,
            # which sheds such a request first) takes every action as allowed.
            online = self.q(next_obs).masked_fill(~(mask | ~mask.any(1, keepdim=True)), -np.inf)
            best = online.argmax(dim=1, keepdim=True)
            target = reward + (1 - done) * gamma * self.target(next_obs).gather(1, best)
        current = self.q(obs).gather(1, action)
        loss = F.smooth_l1_loss(current, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        th.nn.utils.clip_grad_norm_(self.q.parameters(), hyper.max_grad_norm)
        self.optimizer.step()
        self.updates += 1
        if self.updates % max(1, hyper.target_update // hyper.train_freq) == 0:
            self.target.load_state_dict(self.q.state_dict())
        return float(loss.detach())

    def layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """A copy of the online network's weights, for a `DqnPolicy`."""
        return [(w.copy(), b.copy()) for w, b in self._layers]
