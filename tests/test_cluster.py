"""Cluster files: parsing, units, validation with one-line errors, built-ins."""

import math
import re

import pytest

from hap.cost.cluster import BUILTIN, ClusterError, cluster_from_dict, load_cluster

GOOD = """
name: two-kinds
devices:
  - {name: fast, count: 2, flops: 3.5TFLOPS, memory: 16GiB}
  - {name: slow, flops: 1e12, memory: 8GB, gpus: 4, intra_bandwidth: 10GB/s}
network: {bandwidth: 10Gbps, latency: 30us}
"""


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


TWO = "devices: [{flops: 1e12, memory: 1GiB, count: 2}]"


def test_bits_and_bytes_by_the_case_of_b(tmp_path):
    """Gb/s was read as gigabytes a second and GBps as gigabits (units were compared in lower
    case): 8x off, silently."""
    for unit, per_second in (("10Gbps", 1.25e9), ("10Gb/s", 1.25e9), ("10GBps", 1e10), ("10GB/s", 1e10),
                             ("10 gbps", 1.25e9), ("10MiB/s", 10 * 2**20), ("80Mbps", 1e7)):
        c = load_cluster(write(tmp_path, f"{TWO}\nnetwork: {{bandwidth: {unit}}}"))
        assert c.topology.link(0, 1).bandwidth == pytest.approx(per_second), unit


def test_parse_units_and_counts(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    assert c.name == "two-kinds" and c.size == 3 and c.gpus == 6
    assert c.devices[0].flops == 3.5e12 and c.devices[0].memory == 16 * 2**30
    assert c.devices[2].memory == 8e9 and c.devices[2].intra_bandwidth == 10e9
    # 10 Gbps = 1.25e9 bytes/s; ring all-reduce beta = bw * m / (2 (m - 1)) with m = 3.
    assert c.fit("all_reduce").beta == pytest.approx(1.25e9 * 3 / 4)
    assert c.compute_proportional() == pytest.approx([3.5 / 11, 3.5 / 11, 4 / 11])


@pytest.mark.parametrize("text,message", [
    ("devices: [{name: a, flops: 1e12, memory: 0}]", r"devices\[0\] \(a\) memory must be positive, got 0"),
    ("devices: [{name: a, flops: 1e12}]", r"devices\[0\]: missing 'memory'"),
    ("devices: [{name: a, flops: fast, memory: 1GiB}]", r"devices\[0\].flops: cannot read 'fast'"),
    ("devices: [{name: a, flops: 1e12, memory: 1GiB, colour: red}]", r"unknown key\(s\) \['colour'\]"),
    ("devices: []", "'devices' must be a non-empty list"),
    ("devices: [{flops: 1e12, memory: 1GiB}, {flops: 1e12, memory: 1GiB}]", "no cost for collective"),
    ("devices: [{flops: 1e12, memory: 1GiB, gpus: 2}]", "needs intra_bandwidth"),
    ("devices: [{flops: 1e12, memory: 1GiB, count: 0}]", "count must be an integer from 1 to 1024, got 0"),
    ("devices: [{flops: 1e12, memory: 1GiB, count: 100000000}]", "count must be an integer from 1 to 1024"),  # ran minutes
    ("devices: [{flops: 1e12, memory: 1GiB, count: 1000}, {flops: 1e12, memory: 1GiB, count: 1000}]",
     "'devices' lists 2000 devices; hap plans for 1024 at most"),
    ("devices: [{flops: 1e12, memory: 1GiB}]\ncollectives: [1, 2]", "'collectives' must map each collective to"),
    ("devices: [{flops: 1e12, memory: 1GiB}]\ncollectives: {all_sum: {alpha: 1, beta: 1}}", "unknown collective 'all_sum'"),
    ("devices: [{flops: 1e12, memory: 1GiB}]\nnetwork: {latency: 1us}", "'network' needs a bandwidth"),
    ("[1, 2]", "a cluster spec is a mapping"),
    ("devices: [{flops: 1e12, memory: 1GiB}\n", "not valid YAML"),
    # each was taken: the last of two keys won, a device was called None, 16 meant 16 bytes
    ("devices: [{flops: 1e12, memory: 1GiB, memory: 2GiB}]", r"not valid YAML \(key 'memory' is given twice at line 1, column 39\)"),
    # PyYAML's problem and where (it said only "while parsing a flow mapping")
    ("devices: [{flops: 1e12, memory: 1GiB}\nnetwork: {bandwidth: 10Gbps}",
     r"not valid YAML \(expected ',' or ']', but got '<scalar>' at line 2, column 1\)$"),
    # `intra:` left empty on a machine of 2 devices (it took the network card's)
    ("devices: [{flops: 1e12, memory: 1GiB, count: 2}]\nmachines: [{devices: 2, intra: null, nic: {bandwidth: 1Gbps}}]",
     r"machines\[0\]: a machine of 2 devices needs 'intra' \(the link between them\)$"),
    ("devices: [{name: null, flops: 1e12, memory: 1GiB}]", r"devices\[0\]: name must be text, got None"),
    ("devices: [{flops: 1e12, memory: 16}]", r"memory of 16 bytes is less than 1 KiB; give a unit \(say 16GiB\)$"),
    # each crashed with a traceback, was read silently, or made a price infinite
    ("devices: [{flops: 1e12, memory: 1" + "0" * 340 + "}]", r"devices\[0\].memory: a number of 341 digits is out of range$"),
    (f"{TWO}\nmachines: [{{devices: 100000000000000000000, nic: {{bandwidth: 1Gbps}}}}]",
     r"machines\[0\]: devices must be a count from 1 to 1024, got 100000000000000000000$"),
    (f"{TWO}\nnetwork: {{bandwidth: 1e-320GB/s}}", r"network bandwidth of [0-9.e-]+ is out of range"),
    ("devices: [{flops: 1e-300FLOPS, memory: 1GiB}]", r"devices\[0\] \(device0\) flops of 1e-300 is out of range"),
    (f"{TWO}\nnetwork: {{bandwidth: 10, latency: 30us}}", r"network.bandwidth of 10 with no unit; give one \(say 10Gbps\)$"),
    (f"{TWO}\nnetwork: {{bandwidth: 10Gbps, latency: 30}}", r"network.latency of 30 with no unit; give one \(say 30us\)$"),
    # YAML reads these as text: bare numbers all the same
    (f"{TWO}\nnetwork: {{bandwidth: 10Gbps, latency: '30'}}", r"network.latency of 30 with no unit"),
    (f"{TWO}\nnetwork: {{bandwidth: 5e1, latency: 30us}}", r"network.bandwidth of 50 with no unit"),
    (f"{TWO}\nnetwork: {{bandwidth: .nan, latency: 30us}}", r"network.bandwidth must be a finite number, got nan$"),
    (f"{TWO}\nnetwork: {{bandwidth: .inf, latency: 30us}}", r"network.bandwidth must be a finite number, got inf$"),
    (f"{TWO}\nnetwork: {{bandwidth: 10Gbps, latency: '1e400'}}", r"network.latency must be a finite number, got inf$"),
    # a traceback (int too large to convert to float), then errors naming the wrong problem
    (f"{TWO}\nnetwork: {{bandwidth: 1{'0' * 400}, latency: 30us}}", r"network.bandwidth: a number of 401 digits is out of range$"),
    ("devices: [{flops: 1e12, memory: 1GiB, op_overhead: 1" + "0" * 400 + "}]", r"op_overhead: a number of 401 digits is out of range$"),
    (f"{TWO}\nnetwork: {{bandwidth: -1.25e9, latency: 30us}}", r"network bandwidth must be positive, got -1.25e\+09$"),
    (f"{TWO}\nnetwork: {{bandwidth: 10Gbps, latency: -1}}", r"network latency must be non-negative, got -1$"),
    (f"{TWO}\nnetwork: {{bandwidth: 1e400Gbps, latency: 30us}}", r"network bandwidth of inf is out of range"),
    # each was read as bytes/s or seconds: estimates of hours per step
    ("devices: [{flops: 1e12, memory: 1GiB, gpus: 4, intra_bandwidth: 10}]",
     r"devices\[0\] \(device0\) intra_bandwidth of 10 with no unit; give one \(say 100GB/s\)$"),
    ("devices: [{flops: 1e12, memory: 1GiB, mem_bandwidth: 900}]", r"mem_bandwidth of 900 with no unit"),
    ("devices: [{flops: 1e12, memory: 1GiB, op_overhead: 10}]", r"op_overhead of 10 with no unit; give one \(say 10us\)$"),
    ("devices: [{name: v100, flops: 15, memory: 16GiB}]",
     r"devices\[0\] \(v100\) flops of 15 with no unit; give one \(say 15TFLOPS\)$"),
    ("devices: [{flops: '3e1', memory: 16GiB}]", r"flops of 30 with no unit"),
    (f"{TWO}\ncollectives: {{all_reduce: {{alpha: 5, beta: 1e9}}}}", r"collectives.all_reduce.alpha of 5 with no unit"),
    (f"{TWO}\ncollectives: {{all_reduce: {{alpha: 5us, beta: 10}}}}", r"collectives.all_reduce.beta of 10 with no unit"),
    (f"{TWO}\nnetwork: {{bandwidth: 1Gbps, emulate: true}}\ncollectives: {{all_reduce: {{alpha: 5us, beta: 1GB/s}}}}",
     r"collectives: give all of all_reduce, .* \(as measured: hap profile writes them\) or none \(the network prices "
     r"them\); missing: all_gather, reduce_scatter, all_to_all, broadcast$"),  # it said: give 'network' or 'collectives'
    # on machines, a partial section switched every price to measured fits (an all-reduce inside one machine 50x dearer)
    (f"{TWO}\nmachines: [{{name: a, devices: 2, intra: {{bandwidth: 10GB/s}}, nic: {{bandwidth: 1Gbps}}}}]\ncollectives: {{broadcast: {{alpha: 5us, "
     f"beta: 1GB/s}}}}", r"collectives: give all of .* or none \(the machines price them\); missing: all_reduce, "),
    ("devices: [{flops: 1e12, memory: 16Gb}]", r"devices\[0\].memory: cannot read '16Gb' \(a number, or a number with a unit: B, kB,"),
    (f"{TWO}\nmachines: [{{name: m, nic: {{bandwidth: 1Gbps}}}}, {{name: m, nic: {{bandwidth: 1Gbps}}}}]",
     r"machines\[1\]: machine name 'm' is given twice$"),
    (f"{TWO}\nmachines: [{{nic: {{bandwidth: 1Gbps}}}}, {{nic: {{bandwidth: 1Gbps}}}}]\n"
     "links: [{between: [0, 1], bandwidth: 1Gbps}, {between: [1, 0], bandwidth: 100Gbps}]",
     r"links\[1\]: the link between devices 1 and 0 is given twice$"),
    (f"name:\n{TWO}\nnetwork: {{bandwidth: 1Gbps}}", r": name must be text, got None$"),
    # an empty section of the wrong kind was read as none
    (f"{TWO}\nnetwork: {{bandwidth: 1Gbps}}\ncollectives: []", r": 'collectives' must map each collective to \{alpha, beta\}, "
     r"got \[\]$"),
    (f"{TWO}\nmachines: [{{nic: {{bandwidth: 1Gbps}}}}, {{nic: {{bandwidth: 1Gbps}}}}]\nlinks: {{}}",
     r": 'links' must be a list of \{between: \[a, b\], bandwidth, latency\}, got \{\}$"),
])
def test_bad_files_name_the_problem(tmp_path, text, message):
    with pytest.raises(ClusterError, match=message) as e:
        load_cluster(write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_a_directory_or_binary_file_is_not_a_cluster(tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ClusterError, match=r"bin.yaml: not a text file \(a YAML cluster file is UTF-8 text\)$"):
        load_cluster(tmp_path / "bin.yaml")
    with pytest.raises(ClusterError, match="is a directory, not a cluster file$"):
        load_cluster(tmp_path)


def test_unknown_name():
    with pytest.raises(ClusterError, match="no cluster named 'nope'"):
        load_cluster("nope")
    # a dict said "no cluster named '{'devices': []}'", and "" ". is a directory"
    for given in ({"devices": []}, "", None):
        with pytest.raises(ClusterError, match=rf"^load_cluster takes a built-in cluster's name or a YAML file's path, "
                                               rf"got {re.escape(repr(given))} \(a cluster as a dict: "):
            load_cluster(given)


def test_builtins_are_valid_and_paper_shaped():
    for name, make in BUILTIN.items():
        c = make()
        assert c.name == name and c.size >= 2
        assert all(math.isfinite(f.beta) and f.alpha >= 0 for f in c.collectives.values())
    het = BUILTIN["paper-hetero-32"]()
    assert [d.name for d in het.devices] == ["v100"] * 2 + ["p100"] * 6
    assert het.gpus == 32 and all(d.gpus == 4 for d in het.devices)
    assert all(d.name == "p100" for d in BUILTIN["paper-homo-8"]().devices)


ONE_MACHINE = {"name": "m", "devices": [{"name": "g", "count": 1, "flops": 1e12, "memory": "1GiB"}], "emulate": True,
               "machines": [{"name": "a", "devices": 1, "intra": {"bandwidth": "10GB/s"}, "nic": {"bandwidth": "1GB/s"}}]}


@pytest.mark.parametrize("spec", [
    "paper-hetero-16",
    {"name": "e", "devices": [{"name": "g", "count": 2, "flops": 1e12, "memory": "1GiB"}],
     "network": {"bandwidth": "1Gbps", "latency": "30us", "emulate": True}},  # its fits follow from the network
    ONE_MACHINE,  # one device: no links to emulate
    # one local device: its collectives (infinite betas) were written, and refused when read back
    {"name": "solo", "local": True, "devices": [{"name": "cpu", "count": 1, "flops": 1e10, "memory": "1GiB"}]},
    # values a bare number may not give (a unit forgotten): written bare, they were refused when read back
    {"name": "slow", "devices": [{"name": "g", "count": 2, "flops": "2e4FLOPS", "memory": "1GiB", "op_overhead": "1.5s"}],
     "network": {"bandwidth": "4kbps", "latency": "2s", "emulate": True}},
    {"name": "slow-m", "devices": [{"name": "g", "count": 2, "flops": 1e12, "memory": "1GiB", "mem_bandwidth": "500B/s"}],
     "machines": [{"name": "a", "devices": 2, "intra": {"bandwidth": "800B/s", "latency": "1s"}, "nic": {"bandwidth": "1GB/s"}}]},
    {"name": "slow-fits", "devices": [{"name": "g", "count": 2, "flops": 1e12, "memory": "1GiB"}],
     "collectives": {k: {"alpha": "3s", "beta": "900B/s"} for k in
                     ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}},
])
def test_round_trip_through_dict(spec):
    c = BUILTIN[spec]() if isinstance(spec, str) else cluster_from_dict(spec)
    again = cluster_from_dict(c.to_dict())  # one device's read back at all (it was refused: emulate, no machines)
    if c.size == 1:
        assert (again.devices, again.collectives) == (c.devices, c.collectives)
        assert "collectives" not in c.to_dict()
    else:
        assert again == c  # measured_fits too: fits written as collectives were read back as measured


def test_numbers_yaml_reads_as_strings_are_numbers():
    # YAML 1.1 reads 4e-4 (no dot) as a string; a bare number means the base unit
    c = cluster_from_dict({"devices": [{"name": "a", "count": 2, "flops": "9e10", "memory": "1GiB"}],
                           "collectives": {k: {"alpha": "4e-4", "beta": "1e9"} for k in
                                           ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")}})
    assert c.devices[0].flops == 9e10 and c.collectives["all_reduce"].alpha == 4e-4
    # hap clusters prints speeds in TFLOP/s: a file may say so too
    assert cluster_from_dict({"devices": [{"flops": "10 TFLOP/s", "memory": "1GiB"}]}).devices[0].flops == 1e13


def test_an_empty_collectives_section_leaves_the_machines_pricing():
    spec = {"devices": [{"name": "g", "count": 4, "flops": 1e12, "memory": "1GiB"}],
            "machines": [{"name": "a", "devices": 4, "intra": {"bandwidth": "100GB/s"}, "nic": {"bandwidth": "1GB/s"}}]}
    plain, empty = cluster_from_dict(spec), cluster_from_dict({**spec, "collectives": {}})
    assert not empty.measured_fits and empty == plain  # it read as measured fits: the topology's per-size choice off
    net = {"devices": spec["devices"], "network": {"bandwidth": "1GB/s", "emulate": True}}
    assert cluster_from_dict({**net, "collectives": None}) == cluster_from_dict(net)  # (it said: no cost for ...)


def test_hap_cluster_prints_a_cluster_file(capsys):
    """Its description came first, as plain text: the output did not load back."""
    import yaml

    from hap.cli import main

    assert main(["cluster", "paper-hetero-16"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# paper-hetero-16")
    assert cluster_from_dict(yaml.safe_load(text)) == BUILTIN["paper-hetero-16"]()


def test_a_slow_devices_speed_is_told_in_gflops():
    """A 3 GFLOP/s device was described as 0.00 TFLOP/s."""
    cluster = cluster_from_dict({"name": "slow", "devices": [{"name": "a", "flops": 3e9, "memory": "1GiB"},
                                                            {"name": "b", "flops": 9e10, "memory": "1GiB"}],
                                "network": {"bandwidth": "1GB/s", "latency": "10us"}})
    assert cluster.describe() == ("slow: 2 devices, 2 GPUs: 1 x a (1 GPU, 3 GFLOP/s, 1.0 GiB), "
                                  "1 x b (1 GPU, 0.09 TFLOP/s, 1.0 GiB)")
    assert [d["memory"] for d in cluster.to_dict()["devices"]] == [2**30, 2**30]  # (bytes as a whole number: it was 1073741824.0)
    assert all(type(d["memory"]) is int for d in cluster.to_dict()["devices"])
