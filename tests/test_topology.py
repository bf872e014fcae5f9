"""Cluster topology: machines, network cards, link overrides; collectives priced by algorithm."""

import pytest
import torch
import yaml
from hypothesis import given, settings, strategies as hs

from hap.cost.cluster import ClusterError, cluster_from_dict, fits_from_network, load_cluster
from hap.cost.topology import Link, Machine, Topology
from hap.runtime.emulate import Emulation

GB, GBPS = 1e9, 1e9 / 8

# Two machines of two devices: A fast inside (100 GB/s) with a 25 Gbps card, B slower inside
# (16 GB/s) with a 10 Gbps card.
MIXED = {
    "name": "mixed",
    "devices": [{"name": "a100", "count": 2, "flops": 1e14, "memory": "40GiB"},
                {"name": "v100", "count": 2, "flops": 3e13, "memory": "16GiB"}],
    "machines": [{"name": "A", "devices": 2, "intra": {"bandwidth": "100GB/s", "latency": "2us"},
                  "nic": {"bandwidth": "25Gbps", "latency": "10us"}},
                 {"name": "B", "devices": 2, "intra": {"bandwidth": "16GB/s", "latency": "5us"},
                  "nic": {"bandwidth": "10Gbps", "latency": "30us"}}],
}


def test_all_reduce_by_algorithm_worked_example():
    """100 MB all-reduced over the four devices (L = 20 us launch):
    ring: slowest link 10 Gbps / 30 us:  L + 6 * 30us + 2 * 3/4 * 1e8 / 1.25e9      = 120.2 ms
    tree: depth 2:                       L + 4 * 30us + 4 * 1e8 / 1.25e9           = 320.14 ms
    hierarchical: inside (k=2, 16 GB/s, 5 us): 2 * 5us + 2 * 1/2 * 1e8 / 16e9 = 6.26 ms,
          leaders' ring (2, 10 Gbps, 30 us):   2 * 30us + 1e8 / 1.25e9      = 80.06 ms,  + L
    """
    topo = cluster_from_dict(MIXED).topology
    n, group = 1e8, [0, 1, 2, 3]
    assert topo.seconds("all_reduce", n, group, "ring") == pytest.approx(20e-6 + 180e-6 + 0.12)
    assert topo.seconds("all_reduce", n, group, "tree") == pytest.approx(20e-6 + 120e-6 + 0.32)
    assert topo.seconds("all_reduce", n, group, "hierarchical") == pytest.approx(20e-6 + 10e-6 + 6.25e-3 + 60e-6 + 0.08)
    assert topo.best("all_reduce", n, group)[0] == "hierarchical"
    # inside one machine only its own link counts: 2 devices of A, ring = L + 2us + 1e8 / 100e9
    assert topo.seconds("all_reduce", n, [0, 1]) == pytest.approx(20e-6 + 2 * 2e-6 + 1e8 / 100e9)
    assert topo.send(1, 2, 1e6) == pytest.approx(30e-6 + 1e6 / (10 * GBPS))  # A's card to B's: B's is slower
    assert topo.send(2, 3, 1e6) == pytest.approx(5e-6 + 1e6 / (16 * GB))


def test_hierarchical_inside_is_the_slowest_machines_ring():
    """Machine A: 3 devices at 100 GB/s, 2 us; B: 2 devices at 1 GB/s, 5 us; cards 10 Gbps, 30 us.
    Inside, the machines reduce at once: A 2 * 2 * 2us + 2 * 2/3 * n / 100e9, B 2 * 1 * 5us +
    2 * 1/2 * n / 1e9; each term B's. The leaders' ring: 2 * 30us + 2 * 1/2 * n / 1.25e9. It
    took A's size with B's link (2 * 2 * 5us + 2 * 2/3 * n / 1e9), slower than either machine."""
    fast, slow, card = ({"bandwidth": "100GB/s", "latency": "2us"}, {"bandwidth": "1GB/s", "latency": "5us"},
                        {"bandwidth": "10Gbps", "latency": "30us"})
    topo = cluster_from_dict({"devices": [{"flops": 1e13, "memory": "16GiB", "count": 5}],
                              "machines": [{"name": "A", "devices": 3, "intra": fast, "nic": card},
                                           {"name": "B", "devices": 2, "intra": slow, "nic": card}]}).topology
    n = 1e8
    assert topo.seconds("all_reduce", n, range(5), "hierarchical") == pytest.approx(
        20e-6 + 10e-6 + n / 1e9 + 60e-6 + n / 1.25e9)


def test_the_cost_model_prices_all_reduce_by_the_fastest_algorithm():
    from hap.cost.cluster import topology_fit

    cl = cluster_from_dict(MIXED)
    assert cl.fit_at("all_reduce", 1e8).time(1e8) == pytest.approx(cl.topology.best("all_reduce", 1e8, range(4))[1])
    ring = cluster_from_dict({**MIXED, "algorithm": "ring"})
    assert ring.fit_at("all_reduce", 1e8).time(1e8) == pytest.approx(0.1202)
    assert topology_fit(cl.topology, "broadcast", [2, 3]).beta == pytest.approx(16 * GB)


def test_one_slow_network_card_bounds_the_ring():
    """Eight machines of 10 Gbps, one of them with a 1 Gbps card: the all-reduce's bandwidth
    term is 10x the uniform cluster's; a per-pair override slows just one link."""
    base = {"devices": [{"flops": 1e13, "memory": "16GiB", "count": 8}]}
    card = lambda gbps: {"nic": {"bandwidth": f"{gbps}Gbps", "latency": "30us"}}  # noqa: E731
    uniform = cluster_from_dict({**base, "machines": [card(10)] * 8})
    slow = cluster_from_dict({**base, "machines": [card(10)] * 7 + [card(1)]})
    per_byte = lambda cl: 1 / cl.fit("all_reduce").beta  # noqa: E731
    assert per_byte(slow) == pytest.approx(10 * per_byte(uniform))
    override = cluster_from_dict({**base, "machines": [card(10)] * 8,
                                  "links": [{"between": [3, 4], "bandwidth": "2Gbps", "latency": "30us"}]})
    assert per_byte(override) == pytest.approx(5 * per_byte(uniform))
    assert override.topology.send(3, 4, 1e6) == pytest.approx(30e-6 + 1e6 / (2 * GBPS))
    assert override.topology.send(2, 4, 1e6) == uniform.topology.send(2, 4, 1e6)
    # a group that avoids the slow link prices without it
    assert override.topology.seconds("all_reduce", 1e8, [0, 1, 2, 3]) == uniform.topology.seconds("all_reduce", 1e8, [0, 1, 2, 3])


def test_network_files_keep_loading_with_the_same_fits():
    """`network:` is every device its own machine: the ring fits of before (8 devices, 10.4
    Gbps, 30 us: all-reduce alpha = 20 us + 14 * 30 us, beta = 1.3e9 * 8 / 14)."""
    cl = cluster_from_dict({"devices": [{"flops": 1e13, "memory": "16GiB", "count": 8}],
                            "network": {"bandwidth": "10.4Gbps", "latency": "30us"}})
    assert cl.fit("all_reduce").alpha == pytest.approx(440e-6)
    assert cl.fit("all_reduce").beta == pytest.approx(1.3e9 * 8 / 14)
    before = fits_from_network(8, 1.3e9, 30e-6)
    for kind, fit in cl.collectives.items():
        assert (fit.alpha, fit.beta) == (pytest.approx(before[kind].alpha), pytest.approx(before[kind].beta)), kind
    paper = load_cluster("paper-hetero-8")
    assert paper.collectives == fits_from_network(8, 1.3e9, 30e-6) and paper.topology is not None


def test_topology_round_trips_and_describes(tmp_path):
    cl = cluster_from_dict({**MIXED, "links": [{"between": [0, 3], "bandwidth": "1Gbps", "latency": "1ms"}],
                            "algorithm": "hierarchical"})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cl.to_dict()))
    again = load_cluster(path)
    assert again.topology == cl.topology and again.collectives == cl.collectives
    text = cl.topology.describe()
    assert "A: devices [0, 1]" in text and "link 0-3: 1 Gbps, 1000 us" in text


@pytest.mark.parametrize("change,message", [
    ({"machines": [MIXED["machines"][0]]}, "the machines hold 2 devices but 'devices' lists 4"),
    ({"links": [{"between": [0, 9], "bandwidth": "1Gbps"}]}, r"'between' must name two different devices 0..3"),
    ({"links": [{"between": [True, 0], "bandwidth": "1Gbps"}]}, r"'between' must name two different devices"),
    ({"links": 5}, r"'links' must be a list of \{between: \[a, b\], bandwidth, latency\}, got 5"),
    ({"algorithm": "butterfly"}, "algorithm must be one of ring, tree, hierarchical, auto"),
    ({"machines": [{"devices": 4, "nic": {"bandwidth": "1Gbps"}}]}, "a machine of 4 devices needs 'intra'"),
    ({"network": {"bandwidth": "1Gbps"}}, "give 'network' .* or 'machines', not both"),
    ({"machines": [{"devices": 4, "intra": {"bandwidth": "1GB/s"}, "nic": {"speed": 1}}]}, r"machines\[0\].nic: expected"),
])
def test_malformed_topologies_are_one_line_errors(change, message):
    with pytest.raises(ClusterError, match=message) as e:
        cluster_from_dict({**MIXED, **change})
    assert len(str(e.value).splitlines()) == 1


def test_emulation_sleeps_the_topologys_time(monkeypatch):
    import hap.runtime.emulate as emulate
    monkeypatch.setattr(emulate.time, "perf_counter", lambda: 100.0)  # a frozen clock: no wall time in the test
    cl = cluster_from_dict({**MIXED, "emulate": True, "local": True})
    emu = Emulation.for_rank(cl, 0)
    one = emu.links.run_seconds("all_reduce", 1e6, range(cl.size))
    assert one == pytest.approx(cl.fit("all_reduce").time(1e6))
    # the rank's link carries one collective at a time: a second one started at once ends one
    # link time after the first
    first = emu.on_wire("all_reduce", 1e6)
    second = emu.on_wire("all_reduce", 1e6)
    assert second - first == pytest.approx(one)
    assert Emulation.for_rank(cluster_from_dict(MIXED), 0).links is None
    with pytest.raises(ClusterError, match="emulate: true needs 'machines' or 'network'"):
        cluster_from_dict({"devices": MIXED["devices"], "collectives": load_cluster("local-4").to_dict()["collectives"],
                           "emulate": True})


def test_a_hand_built_topology_checks_its_machines():
    fast = Link(bandwidth=1e9, latency=1e-5)
    with pytest.raises(ValueError, match=r"^a topology puts every device 0..n-1 on exactly one machine, got devices "
                                         r"\[0, 2\]$"):
        Topology(machines=(Machine(name="a", devices=(0, 2), intra=fast, nic=fast),))
    two = (Machine(name="a", devices=(0, 1), intra=fast, nic=fast),)
    with pytest.raises(ValueError, match=r"^unknown all-reduce algorithm 'fastest'; choose ring, tree, hierarchical "
                                         r"or auto$"):
        Topology(machines=two, algorithm="fastest")
    with pytest.raises(ValueError, match=r"^a link override joins two different devices 0..1, got 0 and 5$"):
        Topology(machines=two, overrides=((0, 5, fast),))
    with pytest.raises(ValueError, match=r"^a link has a positive bandwidth and a latency at least 0, got bandwidth 0 "):
        Link(bandwidth=0, latency=0.0)
    with pytest.raises(ValueError, match=r"^unknown all-reduce algorithm 'Ring'; choose ring, tree, hierarchical$"):
        Topology(machines=two).seconds("all_reduce", 1e6, [0, 1], "Ring")  # (it was priced as ring)


def test_all_to_all_sends_each_devices_parts_for_the_others():
    """8 devices on their own machines, 1 GB/s cards, 10 us; V = 8e6 bytes (1 MB per device):
    each device sends 7 parts of 1/8 MB, 0.875 MB, at once with the others: L + 7 * 10us +
    0.875e6 / 1e9 = 0.965 ms. An all-gather takes 7 shards of 1 MB into each: L + 70us + 7 ms."""
    topo = cluster_from_dict({"devices": [{"flops": 1e13, "memory": "16GiB", "count": 8}],
                              "network": {"bandwidth": "1GB/s", "latency": "10us"}}).topology
    assert topo.seconds("all_to_all", 8e6, range(8)) == pytest.approx(20e-6 + 70e-6 + 0.875e-3)
    assert topo.seconds("all_gather", 8e6, range(8)) == pytest.approx(20e-6 + 70e-6 + 7e-3)
    # the 8 devices on 2 machines of 4, cards of 1 GB/s, 0 us: each card carries its 4 devices'
    # parts for the 4 elsewhere, 4 * 4 / 64 of V = 2 MB: 2 ms (priced 0.875 ms, as if each had a card)
    card = {"bandwidth": "1GB/s", "latency": "0us"}
    two = cluster_from_dict({"devices": [{"flops": 1e13, "memory": "16GiB", "count": 8}],
                             "machines": [{"name": "A", "devices": 4, "intra": {"bandwidth": "100GB/s"}, "nic": card},
                                          {"name": "B", "devices": 4, "intra": {"bandwidth": "100GB/s"}, "nic": card}]})
    assert two.topology.seconds("all_to_all", 8e6, range(8)) == pytest.approx(20e-6 + 2e-3)
    assert two.topology.seconds("all_to_all", 8e6, range(4)) == pytest.approx(20e-6 + 3 / 16 * 8e6 / 100e9)


class _Squares(torch.nn.Linear):
    def __init__(self):
        super().__init__(4, 1)

    def forward(self, x):
        return super().forward(x).pow(2).mean()


def test_a_groups_machine_gathers_over_its_own_internal_link():
    """Device 0 a machine of 2 GPUs at 1 GB/s inside, devices 1 and 2 of 2 GPUs at 100 GB/s: an
    all-reduce over devices 1 and 2 pays 2 n / 100 GB/s inside (it paid device 0's 1 GB/s)."""
    from hap.capture import capture
    from hap.cost.model import CostModel
    from hap.rules import strategy_table
    from hap.rules.units import ShardClasses
    net = {"bandwidth": "100Gbps", "latency": "0us"}
    cluster = cluster_from_dict({"devices": [
        {"name": "slow", "flops": 1e13, "memory": "16GiB", "gpus": 2, "intra_bandwidth": "1GB/s"},
        {"name": "fast", "flops": 1e13, "memory": "16GiB", "gpus": 2, "intra_bandwidth": "100GB/s", "count": 2}],
        "network": net})
    graph = capture(_Squares(), (torch.randn(3, 4),))
    cost = CostModel(graph, cluster, ShardClasses(graph, enumerate(strategy_table(graph))))
    n = 1e9
    ring = cluster.topology.run_seconds("all_reduce", n, [1, 2])
    assert cost.group_collective("all_reduce", n, [1, 2]) == pytest.approx(ring + 2 * n / 100e9)
    assert cost.group_collective("all_reduce", n, [0, 1]) == pytest.approx(
        cluster.topology.run_seconds("all_reduce", n, [0, 1]) + 2 * n / 1e9)


def test_yaml_merge_keys_load(tmp_path):
    # `<<: *anchor` (a device like another, its name its own) was "not valid YAML"
    path = tmp_path / "anchor.yaml"
    path.write_text("devices:\n  - &v100 {name: v100, flops: 1e13, memory: 16GiB}\n  - {<<: *v100, name: v100b}\n"
                    "network: {bandwidth: 10Gbps, latency: 30us}\n")
    assert [d.name for d in load_cluster(path).devices] == ["v100", "v100b"]
    assert load_cluster(path).devices[1].flops == 1e13


@settings(max_examples=60, deadline=None)
@given(sizes=hs.lists(hs.integers(1, 3), min_size=1, max_size=4), data=hs.data())
def test_the_slowest_pair_is_every_pairs_slowest_link(sizes, data):
    """pairs_link (found from the machines, in linear time) is the slowest of every pair's link,
    overrides included, on random machines, cards, overrides and groups."""
    rate = hs.builds(lambda bw, lat: Link(bandwidth=bw, latency=lat), hs.sampled_from([1e8, 1e9, 1e10, 1e11]),
                     hs.sampled_from([0.0, 1e-6, 1e-5, 1e-4]))
    machines, first = [], 0
    for i, k in enumerate(sizes):
        machines.append(Machine(name=f"m{i}", devices=tuple(range(first, first + k)), intra=data.draw(rate),
                                nic=data.draw(rate)))
        first += k
    pairs = [(a, b) for a in range(first) for b in range(a + 1, first)]
    chosen = data.draw(hs.lists(hs.sampled_from(pairs), unique=True, max_size=3)) if pairs else []
    topo = Topology(machines=tuple(machines), overrides=tuple((a, b, data.draw(rate)) for a, b in chosen))
    group = data.draw(hs.lists(hs.integers(0, first - 1), unique=True, min_size=2, max_size=first)) if first > 1 else []
    if len(group) < 2:
        return
    every = [topo.link(a, b) for a in group for b in group if a < b]
    found = topo.pairs_link(group)
    assert found.bandwidth == min(x.bandwidth for x in every) and found.latency == max(x.latency for x in every)
