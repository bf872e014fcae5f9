"""The DQN of Auto-MAP (seed 004, sections 3 and 4): double DQN with a dueling head, prioritized
replay, epsilon-greedy exploration without noisy layers, depth per task; small, seeded and
deterministic (one torch thread, its own generators).

    agent = Agent(state_dim=64, actions=16, config=DQNConfig(depth=2))
    a = agent.act(state, mask)                       # epsilon-greedy over the allowed actions
    agent.remember(state, a, reward, next_state, next_mask, done)
    agent.learn()                                    # one minibatch step; the target net follows every 100

Targets (double DQN): y = r + gamma * (1 - done) * Q_target(s', argmax_a' Q_online(s', a')),
the argmax over the actions allowed in s'. Dueling: Q(s, a) = V(s) + A(s, a) - mean_a A(s, a).
Paper values: gamma 0.6, epsilon 1.0 -> 0.1 (over 2000 / 500 / 10000 steps for OPP / ADP /
PP), learning rate 1e-3 (PP) or 5e-4 (OPP, ADP), target update every 100, buffer 2000,
replay alpha 0.2, beta 0.6.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import check_fields, number, whole
from .replay import PrioritizedReplay


@dataclass(kw_only=True, slots=True)
class DQNConfig:
    depth: int = 2
    """Hidden layers of the shared trunk (the paper adjusts it per task)."""
    hidden: int = 128
    """Width of every hidden layer."""
    gamma: float = 0.6
    """Discount."""
    lr: float = 1e-3
    epsilon_start: float = 1.0
    epsilon_end: float = 0.1
    epsilon_steps: int = 2000
    """Acting steps over which epsilon decays linearly to its end value."""
    batch: int = 32
    buffer: int = 2000
    alpha: float = 0.2
    beta: float = 0.6
    target_every: int = 100
    """Learning steps between copies of the online net into the target net."""
    seed: int = 0

    def __post_init__(self):
        check_fields(self, depth=whole(0), hidden=whole(1), epsilon_steps=whole(1), batch=whole(1), buffer=whole(1),
                     target_every=whole(1), gamma=number(0, 1), epsilon_start=number(0, 1), epsilon_end=number(0, 1),
                     alpha=number(0, 1), beta=number(0, 1), lr=number(0, above=True))
        if self.batch > self.buffer:
            raise ValueError(f"DQNConfig.batch ({self.batch}) must be at most buffer ({self.buffer}): "
                             "a batch is drawn from the buffer, and the agent would never learn")


class DuelingQNet(nn.Module):
    def __init__(self, state_dim: int, actions: int, hidden: int, depth: int):
        super().__init__()
        layers, width = [], state_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.trunk = nn.Sequential(*layers)
        self.value = nn.Linear(width, 1)
        self.advantage = nn.Linear(width, actions)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        h = self.trunk(s)  # [B, hidden]
        a = self.advantage(h)  # [B, actions]
        return self.value(h) + a - a.mean(-1, keepdim=True)  # [B, actions]


def double_dqn_targets(reward: torch.Tensor, done: torch.Tensor, next_online: torch.Tensor, next_target: torch.Tensor,
                       next_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """y = r + gamma (1 - done) Q_target(s', argmax over allowed a' of Q_online(s', a')).
    next_mask: [B, actions] bool, True where allowed; a state with none allowed must be done."""
    best = next_online.masked_fill(~next_mask, float("-inf")).argmax(-1, keepdim=True)  # [B, 1]
    value = next_target.gather(-1, best).squeeze(-1)  # [B]
    value = torch.where(done.bool(), torch.zeros_like(value), value)
    return reward + gamma * value


class Agent:
    def __init__(self, state_dim: int, actions: int, config: DQNConfig | None = None):
        self.config = cfg = config or DQNConfig()
        self.actions = actions
        with torch.random.fork_rng(devices=[]):  # seeded without touching the caller's random state
            torch.manual_seed(cfg.seed)
            self.online = DuelingQNet(state_dim, actions, cfg.hidden, cfg.depth)
            self.target = DuelingQNet(state_dim, actions, cfg.hidden, cfg.depth)
        self.target.load_state_dict(self.online.state_dict())
        self.opt = torch.optim.Adam(self.online.parameters(), lr=cfg.lr)
        self.replay = PrioritizedReplay(cfg.buffer, cfg.alpha, cfg.beta, seed=cfg.seed)
        self.rng = random.Random(cfg.seed)
        self.acted = 0
        self.learned = 0

    @property
    def epsilon(self) -> float:
        c = self.config
        frac = min(1.0, self.acted / max(1, c.epsilon_steps))
        return c.epsilon_start + frac * (c.epsilon_end - c.epsilon_start)

    @torch.no_grad()
    def q(self, state: torch.Tensor) -> torch.Tensor:
        return self.online(state.unsqueeze(0))[0]

    def act(self, state: torch.Tensor, mask: torch.Tensor, greedy: bool = False) -> int:
        """An allowed action: random with probability epsilon (unless greedy), else the best."""
        allowed = mask.nonzero().flatten().tolist()
        if not allowed:
            raise ValueError("no action is allowed in this state")
        explore = not greedy and self.rng.random() < self.epsilon
        if not greedy:
            self.acted += 1
        if explore:
            return self.rng.choice(allowed)
        return int(self.q(state).masked_fill(~mask, float("-inf")).argmax())

    def remember(self, state, action: int, reward: float, next_state, next_mask, done: bool) -> None:
        self.replay.add((state, action, reward, next_state, next_mask, done))

    def learn(self) -> float | None:
        """One minibatch step (None until the buffer holds a batch); returns the loss."""
        c = self.config
        if len(self.replay) < c.batch:
            return None
        idx, batch, weights = self.replay.sample(c.batch)
        s = torch.stack([b[0] for b in batch])  # [B, state_dim]
        a = torch.tensor([b[1] for b in batch])  # [B]
        r = torch.tensor([b[2] for b in batch], dtype=torch.float32)  # [B]
        s2 = torch.stack([b[3] for b in batch])  # [B, state_dim]
        m2 = torch.stack([b[4] for b in batch])  # [B, actions]
        done = torch.tensor([b[5] for b in batch], dtype=torch.float32)  # [B]
        with torch.no_grad():
            y = double_dqn_targets(r, done, self.online(s2), self.target(s2), m2, c.gamma)
        q = self.online(s).gather(-1, a.unsqueeze(-1)).squeeze(-1)  # [B]
        td = y - q
        loss = (torch.tensor(weights) * F.smooth_l1_loss(q, y, reduction="none")).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.replay.update(idx, td.detach().tolist())
        self.learned += 1
        if self.learned % c.target_every == 0:
            self.target.load_state_dict(self.online.state_dict())
        return float(loss.detach())
