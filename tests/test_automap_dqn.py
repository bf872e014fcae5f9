"""The DQN parts of Auto-MAP (hap.automap): sum tree, prioritized replay, double and dueling
targets, and an agent that learns a tiny task the same way twice."""

import pytest
import torch

from hap.automap.dqn import Agent, DQNConfig, DuelingQNet, double_dqn_targets
from hap.automap.replay import PrioritizedReplay, SumTree


def test_sum_tree_prefix_search():
    t = SumTree(5)  # rounded up to 8 leaves inside; the last 3 stay 0
    for i, p in enumerate([1.0, 2.0, 3.0, 4.0, 0.0]):
        t.set(i, p)
    assert t.total == 10.0
    # prefix intervals: [0,1) -> 0, [1,3) -> 1, [3,6) -> 2, [6,10) -> 3
    assert [t.find(v) for v in (0.0, 0.99, 1.0, 2.99, 3.0, 5.99, 6.0, 9.99)] == [0, 0, 1, 1, 2, 2, 3, 3]
    t.set(1, 0.0)
    assert t.total == 8.0 and t.find(1.0) == 2  # leaf 1 can no longer be hit
    with pytest.raises(ValueError, match="non-negative"):
        t.set(0, -1.0)


def test_prioritized_replay_draws_by_priority_and_weights_the_bias_away():
    buf = PrioritizedReplay(capacity=4, alpha=1.0, beta=1.0, eps=0.0, seed=0)
    for i in range(4):
        buf.add(i)
    buf.update([0, 1, 2, 3], [1.0, 1.0, 1.0, 5.0])  # item 3: 5/8 of the mass
    counts = [0] * 4
    for _ in range(400):
        idx, items, weights = buf.sample(8)
        for i in idx:
            counts[i] += 1
    assert counts[3] / sum(counts) == pytest.approx(5 / 8, abs=0.03)
    idx, items, weights = buf.sample(8)
    # weight (N P(i))^-1 normalized by the largest: 1 for the rare ones, (4 * 1/8) / (4 * 5/8) = 0.2 for item 3
    for i, w in zip(idx, weights):
        assert w == pytest.approx(0.2 if i == 3 else 1.0)


def test_replay_overwrites_the_oldest_and_new_items_get_the_top_priority():
    buf = PrioritizedReplay(capacity=2, alpha=1.0, beta=0.5, eps=0.0, seed=1)
    buf.add("a")
    buf.update([0], [3.0])
    buf.add("b")  # gets priority 3, the largest seen
    assert buf.tree[1] == 3.0
    buf.add("c")  # replaces "a"
    assert sorted(buf.items) == ["b", "c"]


def test_double_dqn_target_takes_the_online_argmax_and_the_target_value():
    online = torch.tensor([[1.0, 5.0, 3.0], [0.0, 2.0, 9.0]])
    target = torch.tensor([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])  # action 2 not allowed in the second
    y = double_dqn_targets(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), online, target, mask, gamma=0.5)
    # first: online argmax is 1, target says 20 -> 1 + 0.5 * 20; second: argmax over {0, 1} is 1 -> 2 + 0.5 * 50
    assert y.tolist() == [11.0, 27.0]
    y = double_dqn_targets(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 0.0]), online, target, mask, gamma=0.5)
    assert y.tolist() == [1.0, 27.0]  # done: the reward alone


def test_dueling_head_means_advantages_to_zero():
    torch.manual_seed(0)
    net = DuelingQNet(4, 3, hidden=8, depth=2)
    s = torch.randn(5, 4)
    q = net(s)
    v = net.value(net.trunk(s))
    assert torch.allclose(q.mean(-1, keepdim=True), v, atol=1e-6)


def _chain(agent, episodes):
    """A 3-step chain: action 1 moves right (reward 1 at the end), action 0 ends with 0."""
    for _ in range(episodes):
        pos = 0
        while True:
            s = torch.nn.functional.one_hot(torch.tensor(pos), 4).float()
            mask = torch.tensor([True, True])
            a = agent.act(s, mask)
            done = a == 0 or pos == 2
            r = 1.0 if (a == 1 and pos == 2) else 0.0
            nxt = pos + 1 if a == 1 and not done else pos
            s2 = torch.nn.functional.one_hot(torch.tensor(nxt), 4).float()
            agent.remember(s, a, r, s2, mask, done)
            agent.learn()
            if done:
                break
            pos = nxt


def test_agent_learns_a_chain_and_is_deterministic():
    torch.set_num_threads(1)
    cfg = DQNConfig(depth=1, hidden=16, gamma=0.9, epsilon_steps=150, batch=16, target_every=20, lr=1e-2, seed=3)
    a, b = Agent(4, 2, cfg), Agent(4, 2, cfg)
    _chain(a, 120)
    _chain(b, 120)
    states = torch.eye(4)[:3]
    assert torch.equal(a.online(states), b.online(states))  # seeded: the same run twice
    assert all(a.act(s, torch.tensor([True, True]), greedy=True) == 1 for s in states)  # go right to the reward


@pytest.mark.parametrize("settings, why", [
    (dict(batch=64, buffer=32), "batch \\(64\\) must be at most buffer \\(32\\)"),
    (dict(target_every=0), "target_every must be a whole number of at least 1, got 0"),
    (dict(batch=0), "batch must be a whole number of at least 1, got 0"),
    (dict(gamma=1.5), "gamma must be a number in \\[0, 1\\], got 1.5"),
    (dict(lr=0.0), "lr must be a number above 0, got 0.0"),
    (dict(epsilon_steps=2.5), "epsilon_steps must be a whole number"),
])
def test_dqn_settings_that_would_never_learn_or_crash_later_are_refused(settings, why):
    with pytest.raises(ValueError, match=f"^DQNConfig.{why}"):
        DQNConfig(**settings)


def test_inference_arguments_are_checked_and_a_path_may_be_text(tmp_path):
    from hap.automap.pipeline_infer import WEIGHTS, GeneratedTable, infer_cuts, main
    import numpy as np
    table = GeneratedTable(np.random.default_rng(0), 2)
    assert infer_cuts(table, weights=str(WEIGHTS))[1] == infer_cuts(table)[1]
    for bad in (dict(beam=0), dict(branch=0)):
        with pytest.raises(ValueError, match="beam and branch must be whole numbers of at least 1"):
            infer_cuts(table, **bad)
    with pytest.raises(SystemExit):  # refused before any training
        main(["--out", str(tmp_path / "missing" / "x.pt"), "--episodes", "1"])
    assert not (tmp_path / "missing").exists()
