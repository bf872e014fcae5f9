"""Auto-MAP's online inference for pipelines (seed 004, section 3.4): a DQN trained once, on
generated (C, A, W) arrays, places the cuts of real models without retraining.

    python -m hap.automap.pipeline_infer --episodes 30000        # trains, writes pp_inference.pt
    cuts, seconds = infer_cuts(table)                           # a StageTable of a real model

The generator draws models as the paper describes them, arrays normalised and coarsened to at
most 128 pivots: a stem, a stack of repeated layers (each a few pivots with their own compute,
activation and parameter profile) and a head, with noise (an instance longer than 128 pivots
is cut there: its last layers and head dropped); heterogeneous device groups (speeds
1 to 2); M = 2K micro-batches; transfers and the gradient all-reduce scaled against compute at
random. Its objective is the pipeline formula of pipeline/price.py on those arrays:
L = sum_k t_k + (M - 1) max_k t_k + max_k sync_k, t_k = compute_k / (speed_k M) + 2 transfer.
The network is the online planner's (same state, same dueling double DQN) and ships with the
package (pp_inference.pt, float16, 0.27 MB). Inference is a beam search over the network's
Q values (beam=1: its greedy rollout), the complete cuts priced by the table's own objective.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from ..pipeline.partition import polish
from ..pipeline.price import iteration_seconds
from .dqn import Agent, DQNConfig
from .pipeline import MAX_STAGES, POLISHED, SLOTS, CutEnvironment, play_episode

WEIGHTS = Path(__file__).with_name("pp_inference.pt")


class GeneratedTable:
    """A pipeline-cut instance from generated arrays, with StageTable's interface."""

    def __init__(self, rng: np.random.Generator, K: int | None = None):
        K = K or int(rng.choice([2, 4, 8]))
        layers = int(rng.integers(max(K, 4), 49))
        per = int(rng.integers(1, 4))
        stem, head = int(rng.integers(0, 3)), int(rng.integers(1, 3))
        shape = rng.lognormal(0, 0.6, size=per)  # one layer's pivots
        comp = np.concatenate([rng.lognormal(0, 0.8, size=stem), np.tile(shape, layers), rng.lognormal(-0.5, 0.8, size=head)])
        comp *= rng.uniform(0.9, 1.1, size=comp.size)
        comp = comp[:SLOTS + 1]
        n = comp.size  # segments between pivots: n - 1 pivots
        act = np.tile(rng.lognormal(0, 0.5, size=per), layers + 6)[:n - 1] * rng.uniform(0.8, 1.2, size=n - 1)
        par = np.concatenate([rng.lognormal(-1, 1.0, size=stem), np.tile(rng.lognormal(0, 0.5, size=per), layers),
                              rng.lognormal(0, 1.0, size=head)])[:n]
        self.K, self.M = K, 2 * K
        self.speed = list(rng.choice([1.0, 1.0, 1.5, 2.0], size=K))
        total = comp.sum()
        self.cum = np.concatenate([[0.0], np.cumsum(comp)]) / total  # compute before position q (fraction)
        self.params = np.concatenate([[0.0], np.cumsum(par)]) / par.sum()
        self.act = act / act.max()
        self.transfer = rng.uniform(0.0, 0.3) / K  # a crossing of the largest activation, in units of the whole compute
        self.sync_scale = rng.uniform(0.0, 0.3)  # the whole model's all-reduce, same units
        self.positions = np.arange(n + 1)
        self.groups = [[k] for k in range(K)]
        Q = n + 1
        send = np.concatenate([[0.0], 2 * self.transfer * self.act, [0.0]])  # after position b
        span = self.cum[None, :] - self.cum[:, None]  # [a, b]
        self.t = np.stack([span / (sp * self.M) + send[None, :] for sp in self.speed])  # [K, a, b]
        self.sync = np.broadcast_to(self.sync_scale * (self.params[None, :] - self.params[:, None]), (K, Q, Q))

    def cut_features(self):
        inner = self.positions[1:-1]
        return self.cum[inner], self.act, self.params[inner], self.speed

    def objective(self, cuts_pos) -> float:
        """L of the stages between consecutive positions, as StageTable.objective."""
        bounds = [0, *cuts_pos, len(self.positions) - 1]
        t = [self.t[k, a, b] for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        s = [self.sync[k, a, b] for k, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        return iteration_seconds(t, s, self.M)


def train(episodes: int = 30000, seed: int = 0, out: Path = WEIGHTS, budget_s: float = 3600.0, log_every: int = 2000) -> Agent:
    """Train the inference network on a fresh generated instance every episode."""
    rng = np.random.default_rng(seed)
    probe = CutEnvironment(GeneratedTable(rng, 2))
    # epsilon reaches its floor after 0.7 x 3 steps per episode; with 11 / 3 cuts per episode on
    # average (K from 2, 4, 8) that is at 57% of the episodes (the shipped weights were trained so)
    cfg = DQNConfig(depth=3, hidden=128, lr=5e-4, gamma=1.0, buffer=20000, epsilon_steps=max(1, int(0.7 * episodes * 3)), seed=seed)
    agent = Agent(probe.state_dim, SLOTS, cfg)
    t0, recent = time.perf_counter(), []
    for e in range(episodes):
        if time.perf_counter() - t0 > budget_s:
            break
        env = CutEnvironment(GeneratedTable(rng))
        recent.append(play_episode(env, agent)[2])
        if log_every and (e + 1) % log_every == 0:
            print(f"episode {e + 1}: mean reward {np.mean(recent[-log_every:]):.3f}, epsilon {agent.epsilon:.2f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    state = {k: v.half() for k, v in agent.online.state_dict().items()}
    torch.save({"state_dict": state, "depth": cfg.depth, "hidden": cfg.hidden, "episodes": len(recent), "seed": seed}, out)
    return agent


_NETS: dict[Path, torch.nn.Module] = {}


def _network(weights: Path = WEIGHTS):
    if weights not in _NETS:
        if not weights.exists():
            raise FileNotFoundError(f"{weights} is missing: train it with python -m hap.automap.pipeline_infer")
        saved = torch.load(weights, weights_only=True)
        from .dqn import DuelingQNet
        net = DuelingQNet(5 * SLOTS + MAX_STAGES + 1, SLOTS, saved["hidden"], saved["depth"])
        net.load_state_dict({k: v.float() for k, v in saved["state_dict"].items()})
        _NETS[weights] = net.eval()
    return _NETS[weights]


@torch.no_grad()
def infer_cuts(table, beam: int = 32, weights: Path = WEIGHTS, branch: int = 4,
               polished: bool = True) -> tuple[tuple[int, ...], float, float]:
    """(cut node positions, L, seconds taken) of the shipped network on `table`: a beam search
    over the network's Q values (each step expands every kept sequence by its `branch` best cuts and
    keeps the `beam` sequences of highest Q), the complete sequences priced by the table's
    objective, the best few then polished by a local search (partition.polish; polished=False:
    the network's own best). beam=1 is the greedy rollout."""
    if not (isinstance(beam, int) and beam >= 1 and isinstance(branch, int) and branch >= 1):
        raise ValueError(f"infer_cuts: beam and branch must be whole numbers of at least 1, got {beam!r} and {branch!r}")
    t0 = time.perf_counter()
    net, env = _network(Path(weights)), CutEnvironment(table)
    frontier = [((), 0, 0.0)]  # (cuts as pivot indices, previous pivot, Q of the last choice)
    for k in range(env.K - 1):
        states = torch.stack([env.state(k, prev) for _, prev, _ in frontier])
        masks = torch.stack([env.allowed(k, prev) for _, prev, _ in frontier])
        q = net(states).masked_fill(~masks, float("-inf"))  # [frontier, SLOTS]
        width = min(branch if beam > 1 else 1, int(masks.sum(-1).min()))
        top = q.topk(width, dim=-1)
        nxt = [(cuts + (a + 1,), a + 1, float(v))
               for (cuts, _, _), vals, acts in zip(frontier, top.values, top.indices)
               for v, a in zip(vals.tolist(), acts.tolist())]
        frontier = sorted(nxt, key=lambda x: -x[2])[:beam]
    ranked = sorted({c: table.objective(c) for c, _, _ in frontier}.items(), key=lambda kv: kv[1])
    best = ranked[0][::-1]
    if polished:  # the few best (distinct) sequences, as the online DQN's, one that does not fit too
        best = min(polish(table, c)[::-1] for c, _ in ranked[:POLISHED])
    cuts = tuple(int(table.positions[c]) for c in best[1])
    return cuts, best[0], time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Train Auto-MAP's pipeline inference network on generated arrays.")
    ap.add_argument("--episodes", type=int, default=30000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=float, default=3600.0, help="seconds at most")
    ap.add_argument("--out", type=Path, default=WEIGHTS)
    args = ap.parse_args(argv)
    if not args.out.parent.is_dir():  # said now, not after an hour of training
        ap.error(f"--out {args.out}: no directory {args.out.parent}")
    torch.set_num_threads(1)
    train(args.episodes, args.seed, args.out, args.budget)
    rng = np.random.default_rng(args.seed + 1)
    _NETS.pop(args.out, None)
    from ..pipeline.partition import exact_partition
    gaps = []
    for _ in range(100):
        table = GeneratedTable(rng)
        gaps.append(infer_cuts(table, weights=args.out)[1] / exact_partition(table).seconds - 1)
    print(f"held-out generated instances: mean gap {np.mean(gaps) * 100:.2f}%, median {np.median(gaps) * 100:.2f}%, "
          f"max {np.max(gaps) * 100:.2f}% over {len(gaps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
