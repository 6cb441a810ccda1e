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

    def __post_init__(self) -> None:
        self.obs = np.zeros((self.size, self.obs_size), np.float32)
        self.next_obs = np.zeros((self.size, self.obs_size), np.float32)
        self.action = np.zeros(self.size, np.int64)
        self.reward = np.zeros(self.size, np.float32)
        self.done = np.zeros(self.size, np.float32)
        self.next_mask = np.ones((self.size, self.actions), bool)

    def add(
        self,
        obs: np.ndarray,
        action: int,
        reward: float,
        next_obs: np.ndarray,
        done: bool,
        next_mask: np.ndarray,
    ) -> int:
        """Store a transition; its slot, for rewards that come later (`credit`)."""
        slot = self.pos
        self.obs[slot], self.next_obs[slot] = obs, next_obs
        self.action[slot], self.reward[slot], self.done[slot] = action, reward, done
        self.next_mask[slot] = next_mask
        self.pos = (slot + 1) % self.size
        self.full = self.full or self.pos == 0
        return slot

    def credit(self, slot: int, reward: float) -> None:
        self.reward[slot] += reward

    def __len__(self) -> int:
        return self.size if self.full else self.pos

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` slots, uniformly, counted back from the newest (as the shipped policies were
        trained: the same draws give the same slots, so their runs reproduce)."""
        return (self.pos - 1 - rng.integers(0, len(self), size=n)) % self.size


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
        idx = buffer.sample(hyper.batch_size, self.rng)
        obs = th.from_numpy(buffer.obs[idx])
        next_obs = th.from_numpy(buffer.next_obs[idx])
        action = th.from_numpy(buffer.action[idx]).unsqueeze(1)
        reward = th.from_numpy(buffer.reward[idx]).unsqueeze(1)
        done = th.from_numpy(buffer.done[idx]).unsqueeze(1)
        mask = th.from_numpy(buffer.next_mask[idx])
        with th.no_grad():
            # Double Q: the online network picks the next action among those allowed, the
            # target network values it. A state that allows none (it cannot occur in a route,
            # which sheds such a request first) takes every action as allowed.
            online = self.q(next_obs).masked_fill(~(mask | ~mask.any(1, keepdim=True)), -np.inf)
            best = online.argmax(dim=1, keepdim=True)
            target = reward + (1 - done) * hyper.gamma * self.target(next_obs).gather(1, best)
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
