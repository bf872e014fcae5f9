"""Auto-MAP's propagation, linkage groups, and the operator-partitioning (OPP) and data-parallel
(ADP) environments on hap's IR (no process group)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hap.automap.opp import (CONFLICT_REWARD, REPLICATE_REWARD, SPLIT_REWARD, DataEnvironment, OperatorEnvironment,
                             search_layout, unit_status)
from hap.automap.propagate import WHOLE, Propagation, derivable, layout_name
from hap.capture import capture
from hap.cost.cluster import load_cluster
from hap.planner import batched_inputs


class MLP(nn.Module):
    """fc1 -> relu -> fc2 -> layer norm -> squared error: Megatron's pair of linears."""

    def __init__(self, width=16, hidden=32):
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(width, hidden), nn.Linear(hidden, width), nn.LayerNorm(width)

    def forward(self, x, y):
        return ((self.ln(self.fc2(torch.relu(self.fc1(x)))) - y) ** 2).mean()


@pytest.fixture(scope="module")
def mlp():
    return capture(MLP(), (torch.randn(8, 16), torch.randn(8, 16)), name="mlp")


def names(prop, doms, graph):
    return {p.removeprefix("p_"): sorted(map(layout_name, prop.layouts(doms, p))) for p in graph.params}


def test_derivations_allowed_between_producer_and_consumer():
    S0, S1 = 2, 3
    assert derivable(1, WHOLE) and derivable(WHOLE, S1) and derivable(S0, S0)
    assert not derivable(S0, WHOLE) and not derivable(S0, S1) and not derivable(1, S0) and not derivable(WHOLE, 1)


def test_propagation_ends_in_its_three_ways(mlp):
    prop = Propagation(mlp, 4, mlp.params, data=mlp.inputs)
    doms, outcome = prop.initial()
    assert outcome == "insufficient"
    # the rules alone: fc2 cannot be split on its output features (the layer norm needs them
    # whole, and gathering is not a derivation); fc2's bias joins row-split fc2 as P: whole
    assert names(prop, doms, mlp)["fc2_weight"] == ["S(1)", "W"]
    assert names(prop, doms, mlp)["fc2_bias"] == ["W"]
    # column-split fc1 decides everything: its bias split, fc2 row-split (Megatron's MLP)
    col, outcome = prop.decide(doms, "p_fc1_weight", 0)
    assert outcome == "complete"
    assert names(prop, col, mlp) == {"fc1_weight": ["S(0)"], "fc1_bias": ["S(0)"], "fc2_weight": ["S(1)"],
                                     "fc2_bias": ["W"], "ln_weight": ["W"], "ln_bias": ["W"]}
    # ... after which a whole fc2 is a conflict
    _, outcome = prop.decide(col, "p_fc2_weight", None)
    assert outcome == "conflict"


def test_decided_variables_are_used_exactly_but_data_may_be_sliced(mlp):
    # OPP: the data are whole but row-split fc1 slices x locally: allowed
    prop = Propagation(mlp, 4, mlp.params, data=mlp.inputs)
    doms, _ = prop.initial()
    _, outcome = prop.decide(doms, "p_fc1_weight", 1)
    assert outcome != "conflict"
    # ADP: x split on its features, parameters whole: the first linear has no strategy
    adp = Propagation(mlp, 4, mlp.inputs, whole=mlp.params)
    doms, _ = adp.initial()
    _, outcome = adp.decide(doms, "x", 1)
    assert outcome == "conflict"
    doms, outcome = adp.decide(doms, "x", 0)
    assert outcome == "complete" and adp.layouts(doms, "y") == {2}  # y must follow x's batch split


def test_dims_smaller_than_the_device_count_are_not_decisions():
    g = capture(MLP(width=16, hidden=3), (torch.randn(8, 16), torch.randn(8, 16)))
    prop = Propagation(g, 4, g.params, data=g.inputs)
    assert prop.splittable("p_fc1_weight") == [1]  # [3, 16]: 3 rows cannot go to 4 devices
    assert prop.splittable("p_fc1_bias") == []


def test_linkage_groups_and_the_paper_reward(mlp):
    env = OperatorEnvironment(mlp, load_cluster("local-4"), reward="paper")
    fc1_out, fc1_in = ("p_fc1_weight", 0), ("p_fc1_weight", 1)
    # splitting fc1 on its outputs forces: not on its inputs, its bias split, fc2 split on its
    # inputs (row); fc2 on its outputs was excluded by the rules before any decision
    assert env.linkage[(fc1_out, 1)] == {fc1_in: 0, ("p_fc1_bias", 0): 1, ("p_fc2_weight", 1): 1}
    # larger linkage groups first
    sizes = [max(len(env.linkage[(u, a)]) for a in (0, 1)) for u in env.units]
    assert sizes == sorted(sizes, reverse=True)
    ep = env.reset()
    while env.units[ep.position] != fc1_out:
        env.step(ep, 0)
    before = dict(ep.status)
    r = env.step(ep, 1)
    gained = {u: ep.status[u] for u in env.units if before[u] < 0 <= ep.status[u]}
    assert gained == {fc1_out: 1, fc1_in: 0, ("p_fc1_bias", 0): 1, ("p_fc2_weight", 1): 1}
    assert r == pytest.approx(3 * SPLIT_REWARD + 1 * REPLICATE_REWARD)  # 1.3


def test_a_conflicting_decision_ends_the_episode_with_the_penalty(mlp):
    env = OperatorEnvironment(mlp, load_cluster("local-4"), reward="paper")
    prop, ep = env.prop, env.reset()
    # a state propagation has not seen through: fc1 column-split, fc2 whole, fc1's bias open
    layouts = list(ep.doms.layouts)
    layouts[prop.tid["p_fc1_weight"]] = frozenset({2})
    layouts[prop.tid["p_fc2_weight"]] = frozenset({WHOLE})
    ep.doms = type(ep.doms)(tuple(layouts), ep.doms.alive)
    ep.status = {u: unit_status(prop, ep.doms, u) for u in env.units}
    ep.position = env.units.index(("p_fc1_bias", 0))
    assert env.step(ep, 1) == CONFLICT_REWARD and ep.done and ep.conflict
    assert env.final_reward(ep) == (CONFLICT_REWARD, math.inf)


@pytest.fixture(scope="module")
def wide():
    # large enough that splitting pays on the paper's cluster; small enough for a fast A*
    return capture(MLP(width=1024, hidden=4096), (torch.randn(256, 1024), torch.randn(256, 1024)), name="wide-mlp")


def test_cost_reward_dqn_finds_astars_optimum_and_beats_the_paper_reward(wide):
    cluster = load_cluster("paper-hetero-8")
    env = OperatorEnvironment(wide, cluster, reward="cost")
    exact, fits, exhaustive = env.exact()
    assert exhaustive and fits and exact < env.replicated  # splitting pays here
    found = search_layout(env, episodes=120, seed=0)
    assert found.seconds == pytest.approx(exact, rel=1e-9)
    paper = search_layout(OperatorEnvironment(wide, cluster, reward="paper"), episodes=60, seed=0)
    assert math.isfinite(paper.seconds) and found.seconds <= paper.seconds
    assert paper.split_tensors >= found.split_tensors  # the paper's reward splits at least as much


def test_adp_finds_the_batch_dims_hap_captures(mlp):
    env = DataEnvironment(mlp, 4)
    found = search_layout(env, episodes=60, seed=0)
    assert env.batch_dims(found.best) == {"x": 0, "y": 0}  # the planner's batch inputs, split on dim 0
    assert batched_inputs(mlp) == {"x", "y"}
    assert found.split_tensors > len(mlp.inputs)


def test_a_layout_that_fits_memory_beats_a_faster_one_that_does_not(wide):
    import dataclasses

    from hap.search.program import memory
    base = load_cluster("paper-hetero-8")
    pricer = OperatorEnvironment(wide, base, reward="cost").pricer
    replicated = pricer.price({p: WHOLE for p in wide.params})[2]
    need = max(memory(replicated, pricer.cost, pricer.segment_of, [pricer.ratios]))
    # devices 10% smaller than the replicated layout needs
    tight = dataclasses.replace(base, devices=tuple(dataclasses.replace(d, memory=int(need * 0.9)) for d in base.devices))
    env = OperatorEnvironment(wide, tight, reward="cost")
    assert not env.pricer.price({p: WHOLE for p in env.params})[1]  # replicating no longer fits
    found = search_layout(env, episodes=60, seed=0)
    seconds, fits, _, _ = env.pricer.price(env.layout(found.best))
    assert fits and seconds == pytest.approx(found.seconds)


def test_the_optimizer_named_is_the_one_whose_state_counts(wide):
    """opp_plan took the optimizer and dropped it: the DQN's layouts were priced with Adam's two
    states whatever the plan was for (sgd needs none: a layout can fit that Adam's would not)."""
    from hap.search.program import memory
    cluster = load_cluster("paper-hetero-8")
    need = {}
    for optimizer in ("adam", "sgd"):
        pricer = OperatorEnvironment(wide, cluster, reward="cost", optimizer=optimizer).pricer
        program = pricer.price({p: WHOLE for p in wide.params})[2]
        need[optimizer] = max(memory(program, pricer.cost, pricer.segment_of, [pricer.ratios]))
    weights = sum(wide.tensors[p].nbytes for p in wide.params if wide.tensors[p].requires_grad)
    assert need["adam"] - need["sgd"] == pytest.approx(2 * weights, rel=1e-6)  # Adam's two moments, replicated
