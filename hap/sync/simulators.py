"""Learned simulators of a strategy's runtime (AutoSync, main paper section 3.1; supplement 4-5).

Every strategy is a sequence of parts (each part of each synchronized parameter, in backprop
order) with, per part, raw features (its bytes, kind, server, group, ...) and predefined ones
(its terms in AutoSync's analytic model, its bucket's collectives in hap's overlap model), plus
the two models' totals. Three simulators map that to a score whose order predicts the measured
order (smaller: faster):

- linear: a linear function of the parts' mean and max features;
- RNN (Eq. 4-7): z_i = MLP_i(raw_i ++ pre_i); an LSTM reads z in backprop order, another in
  reverse; f = MLP_o(last states of both);
- GAT (Eq. 8-10): two graph-attention layers over the parts (edges: neighbours in backprop order,
  and parts of one bucket), the mean of the node states, a linear layer.

All train on measured trials with a pairwise ranking loss, log(1 + exp(f(a) - f(b))) for each
pair whose measured times say a is faster than b by more than `MARGIN`, over pairs of one
(model, cluster): Adam at 1e-3, the rate times 0.3 at 40% and 80% of the epochs, gradient norm
clipped to 0.25. Trials of other models or clusters train the same simulator (transfer).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
import torch.nn as nn

from ..cost.model import CostModel
from ..search.program import Estimate
from . import price
from .strategy import SyncStrategy, Variables

MARGIN = 0.02  # pairs whose measured times differ by less are not ranked (noise)
RAW = 12
PRE = 7
FEATURES = RAW + PRE


@dataclass
class Domain:
    """A (model, cluster) as the simulators see it: its variables, cost model and plan estimate."""
    name: str
    variables: Variables
    cost: CostModel
    estimate: Estimate

    @property
    def compute(self) -> float:
        b = self.estimate.breakdown()
        return b["forward_compute"] + b["backward_compute"] + b["communication"]


def features(domain: Domain, strategy: SyncStrategy) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """[parts, FEATURES] for a strategy, and the GAT's edges (index pairs, both ways)."""
    vs, cost, est = domain.variables, domain.cost, domain.estimate
    entries = vs.entries(strategy)
    buckets = price.buckets(entries, vs)
    bucket_phases = {b.entries[0].bucket: price.phases(b, vs, cost) for b in buckets}
    compute = max(domain.compute, 1e-9)
    total_overlap = price.overlapped(entries, vs, cost, est) / compute
    total_analytic = price.analytic(entries, vs, cost, compute) / compute
    topo = cost.cluster.topology
    fastest = max((m.nic.bandwidth for m in topo.machines), default=1.0) if topo else 1.0
    index = {v.param: i for i, v in enumerate(vs.vars)}
    bucket_first: dict[int, bool] = {}
    rows, bucket_of = [], []
    for e in entries:
        var = vs.vars[index[e.param]]
        part_rows = e.rows[1] if e.rows is not None else var.rows
        nbytes = price._part_bytes(var, e)
        first, then = bucket_phases[e.bucket]
        parts_of_var = sum(1 for x in entries if x.param == e.param)
        server_bw = (topo.machines[topo.machine_of(e.server)].nic.bandwidth / fastest) if topo and e.server is not None else 0.0
        server_shared = float(e.server is not None and any(e.server in m and len(m) > 1 for m in vs.machines))
        messages = (len(vs.machines) - 1 if e.hierarchical else vs.devices - 1) / max(1, vs.devices)
        transfer = 2 * nbytes / _slowest_bandwidth(cost) / compute
        rows.append([
            math.log2(max(nbytes, 1.0)) / 32, part_rows / var.rows, index[e.param] / len(vs.vars),
            float(e.strategy == "ps"), float(e.hierarchical), float(e.compressor == "fp16"),
            float(e.compressor == "powersgd"), e.bucket / max(1, len(buckets)), server_bw, server_shared,
            parts_of_var / 16, float(var.sparse),
            transfer, messages, float(not bucket_first.get(e.bucket)), first / compute, then / compute,
            total_overlap, total_analytic])
        bucket_first[e.bucket] = True
        bucket_of.append(e.bucket)
    edges = [(i, i + 1) for i in range(len(rows) - 1)]
    last_in: dict[int, int] = {}
    for i, b in enumerate(bucket_of):
        if b in last_in and last_in[b] != i - 1:
            edges.append((last_in[b], i))
        last_in[b] = i
    edges = edges + [(j, i) for i, j in edges]
    return torch.tensor(rows, dtype=torch.float32), edges


def _slowest_bandwidth(cost: CostModel) -> float:
    """The slowest link of a ring over every device, as the prices take it."""
    return price._ring_bandwidth(cost.cluster.topology, range(cost.cluster.size), cost)


# -- the three simulators ----------------------------------------------------------------------

@dataclass(frozen=True)
class Padded:
    """Samples as one batch, each padded to the longest's parts: every simulator scores a batch
    at once (a sample alone is a batch of one, with no padding)."""
    x: torch.Tensor
    """[B, N, FEATURES]: each sample's parts, zeros after its last."""
    lengths: torch.Tensor
    """[B]: each sample's number of parts (int64, on the CPU, as pack_padded_sequence takes it)."""
    adjacency: torch.Tensor
    """[B, N, N] bool: the GAT's edges and every node's self-loop (a padded node's alone: it
    attends to itself, so no softmax row is empty, and no part attends to it)."""
    reversed_index: torch.Tensor
    """[B, N]: position i of each sample read backwards (its parts last to first, then padding)."""

    @staticmethod
    def of(samples: Sequence[Sample]) -> "Padded":
        lengths = torch.tensor([s.x.shape[0] for s in samples], dtype=torch.int64)
        if len(samples) == 0 or int(lengths.min()) == 0:
            raise ValueError("a simulator scores strategies of at least one synchronized part each")
        b, n = len(samples), int(lengths.max())
        x = torch.zeros(b, n, FEATURES)
        adjacency = torch.eye(n, dtype=torch.bool).repeat(b, 1, 1)
        for i, s in enumerate(samples):
            x[i, :s.x.shape[0]] = s.x
            if s.edges:
                edge = torch.tensor(s.edges)
                adjacency[i, edge[:, 0], edge[:, 1]] = True
        at = torch.arange(n).expand(b, n)
        back = lengths.unsqueeze(1) - 1 - at
        return Padded(x, lengths, adjacency, torch.where(back >= 0, back, at))

    def rows(self, index: Sequence[int]) -> "Padded":
        """The batch of these samples alone, padded to the longest of them."""
        i = torch.tensor(index, dtype=torch.int64)
        n = int(self.lengths[i].max())
        return Padded(self.x[i, :n], self.lengths[i], self.adjacency[i, :n, :n], self.reversed_index[i, :n])

    @property
    def mask(self) -> torch.Tensor:
        """[B, N, 1]: 1.0 at a part, 0.0 at padding."""
        return (torch.arange(self.x.shape[1]) < self.lengths.unsqueeze(1)).unsqueeze(-1).to(self.x.dtype)

    def mean(self, h: torch.Tensor) -> torch.Tensor:
        """[B, D]: the mean of h [B, N, D] over each sample's parts."""
        return (h * self.mask).sum(1) / self.lengths.unsqueeze(1).to(h.dtype)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(2 * FEATURES, 1)

    def forward(self, batch: Padded) -> tuple[torch.Tensor, torch.Tensor]:
        top = batch.x.masked_fill(batch.mask == 0, float("-inf")).max(1).values  # [B, F]
        h = torch.cat([batch.mean(batch.x), top], -1)  # [B, 2F]
        return self.out(h).squeeze(-1), h


class RNN(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden))  # MLP_i
        self.fwd = nn.LSTM(hidden, hidden, batch_first=True)
        self.bwd = nn.LSTM(hidden, hidden, batch_first=True)
        self.out = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))  # MLP_o

    def forward(self, batch: Padded) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.inp(batch.x)  # [B, N, H]
        back = z.gather(1, batch.reversed_index.unsqueeze(-1).expand_as(z))  # each sample's parts reversed
        _, (h_fwd, _) = self.fwd(_packed(z, batch.lengths))  # in backprop order, to each sample's last part
        _, (h_bwd, _) = self.bwd(_packed(back, batch.lengths))  # and reversed
        h = torch.cat([h_fwd[-1], h_bwd[-1]], -1)  # [B, 2H]
        return self.out(h).squeeze(-1), h


def _packed(z: torch.Tensor, lengths: torch.Tensor):
    return nn.utils.rnn.pack_padded_sequence(z, lengths, batch_first=True, enforce_sorted=False)


class GATLayer(nn.Module):
    """Graph attention (Velickovic et al.): per head, e_ij = LeakyReLU(a^T [W h_i ++ W h_j]) over
    the edges (and self-loops), softmax over j, h'_i = ELU(sum_j alpha_ij W h_j), heads concatenated."""

    def __init__(self, dim_in: int, dim_out: int, heads: int = 4):
        super().__init__()
        self.heads, self.dim = heads, dim_out
        self.w = nn.Linear(dim_in, heads * dim_out, bias=False)
        self.a_src = nn.Parameter(torch.randn(heads, dim_out) * 0.1)
        self.a_dst = nn.Parameter(torch.randn(heads, dim_out) * 0.1)

    def forward(self, x: torch.Tensor, adjacency: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[:2]
        wh = self.w(x).view(b, n, self.heads, self.dim)  # [B, N, heads, D]
        scores = (wh * self.a_dst).sum(-1).unsqueeze(2) + (wh * self.a_src).sum(-1).unsqueeze(1)  # [B, N(i), N(j), heads]
        scores = nn.functional.leaky_relu(scores, 0.2).masked_fill(~adjacency.unsqueeze(-1), float("-inf"))
        alpha = torch.softmax(scores, dim=2)  # over j
        out = torch.einsum("bijh,bjhd->bihd", alpha, wh)  # [B, N, heads, D]
        return nn.functional.elu(out.reshape(b, n, self.heads * self.dim))


class GAT(nn.Module):
    def __init__(self, hidden: int = 16, heads: int = 4):
        super().__init__()
        self.g1 = GATLayer(FEATURES, hidden, heads)
        self.g2 = GATLayer(hidden * heads, hidden, heads)
        self.q = nn.Linear(hidden * heads, 1)

    def forward(self, batch: Padded) -> tuple[torch.Tensor, torch.Tensor]:
        h = batch.mean(self.g2(self.g1(batch.x, batch.adjacency), batch.adjacency))  # Eq. 9: the mean over parts
        return self.q(h).squeeze(-1), h


Kind = Literal["linear", "rnn", "gat"]
KINDS: dict[str, type[nn.Module]] = {"linear": Linear, "rnn": RNN, "gat": GAT}


@dataclass
class Sample:
    domain: str
    x: torch.Tensor
    edges: list
    seconds: float
    strategy: str = ""
    """The strategy measured, as what the runtime runs (the repr of Variables.key): two samples
    of one are one strategy measured twice, whose times differ by noise alone: no pair to rank.
    "": unnamed."""


def pairs(samples: Sequence[Sample]) -> list[tuple[int, int]]:
    """(faster, slower) index pairs of two strategies within each domain, measured apart by
    more than MARGIN (a strategy measured again, as a search's baselines and confirmations
    are, is no pair: every ranker scores its two alike)."""
    out = []
    for i, a in enumerate(samples):
        for j, b in enumerate(samples):
            if a.domain == b.domain and a.seconds < b.seconds * (1 - MARGIN) and not (a.strategy and a.strategy == b.strategy):
                out.append((i, j))
    return out


class Simulator:
    """One learned simulator, trained by pairwise ranking."""

    def __init__(self, kind: Kind, seed: int = 0):
        if kind not in KINDS:
            raise ValueError(f"unknown simulator {kind!r}; choose {', '.join(KINDS)}")
        torch.manual_seed(seed)
        self.kind, self.seed = kind, seed
        self.net = KINDS[kind]()

    def scores(self, samples: Sequence[Sample]) -> list[float]:
        with torch.no_grad():
            return [x for chunk in _chunks(samples) for x in self.net(Padded.of(chunk))[0].tolist()]

    def embeddings(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [h for chunk in _chunks(samples) for h in self.net(Padded.of(chunk))[1]]

    def train(self, samples: Sequence[Sample], epochs: int = 60, batch: int = 64, pairs_per_epoch: int = 256) -> float:
        """Fit on the samples' ranking pairs, each epoch on at most `pairs_per_epoch` of them
        drawn afresh (the pairs grow as the square of the trials; the steps should not); the
        last epoch's mean loss (nan: no pairs)."""
        every = pairs(samples)
        if not every:
            return float("nan")
        padded = Padded.of(samples)
        opt = torch.optim.Adam(self.net.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[int(0.4 * epochs), int(0.8 * epochs)], gamma=0.3)
        rng = random.Random(self.seed)
        last = float("nan")
        for _ in range(epochs):
            ranked = rng.sample(every, min(len(every), pairs_per_epoch))
            losses = []
            for start in range(0, len(ranked), batch):
                chunk = ranked[start:start + batch]
                need = sorted({i for pair in chunk for i in pair})
                at = {i: k for k, i in enumerate(need)}
                score = self.net(padded.rows(need))[0]  # [len(need)]
                faster = torch.tensor([at[a] for a, _ in chunk])
                slower = torch.tensor([at[b] for _, b in chunk])
                loss = nn.functional.softplus(score[faster] - score[slower]).mean()
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.net.parameters(), 0.25)
                opt.step()
                losses.append(loss.item())
            sched.step()
            last = sum(losses) / len(losses)
        return last


SCORED_AT_ONCE = 64
"""Samples a simulator scores in one batch (a GAT's attention is [batch, parts, parts, heads])."""


def _chunks(samples: Sequence[Sample]) -> list[Sequence[Sample]]:
    return [samples[i:i + SCORED_AT_ONCE] for i in range(0, len(samples), SCORED_AT_ONCE)]


def ranking_accuracy(scores: Sequence[float], samples: Sequence[Sample]) -> float:
    """The share of ranked pairs (pairs()) whose scores order them as measured, a pair scored
    alike counting half, as a coin would (nan: no pair)."""
    ranked = pairs(samples)
    if not ranked:
        return float("nan")
    return sum(1.0 if scores[a] < scores[b] else 0.5 if scores[a] == scores[b] else 0.0 for a, b in ranked) / len(ranked)
