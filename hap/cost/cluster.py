"""Cluster specifications: devices and collective fits, from a YAML file or built in.

A cluster is a list of virtual devices. A virtual device is one GPU, or one machine of
`gpus` identical GPUs that train data-parallel among themselves (HAP section 3: the planner
shards across machines; inside a machine the GPUs split the machine's share of the batch).

Every collective is costed as time = alpha + volume / beta (seconds, bytes, bytes/s), where
volume is defined per collective in hap/cost/model.py. A file may give the fits directly
(as `hap profile` writes them) or give the network's link bandwidth and latency, from which
ring-algorithm fits are derived (see `fits_from_network`).

File format (YAML):

    name: my-cluster
    devices:                      # in rank order; `count` repeats an entry
      - {name: v100, count: 2, flops: 3.86e12, memory: 16GiB, gpus: 1}
      - {name: p100, count: 6, flops: 2.15e12, memory: 16GiB}
    network: {bandwidth: 10.4Gbps, latency: 30us}   # every device its own machine; or:
    machines:                     # the devices, in rank order, on machines (cost/topology.py)
      - {name: node-a, devices: 2, intra: {bandwidth: 100GB/s, latency: 2us},
         nic: {bandwidth: 25Gbps, latency: 10us}}
      - {name: node-b, devices: 6, intra: {bandwidth: 16GB/s, latency: 5us},
         nic: {bandwidth: 10Gbps, latency: 30us}}
    links:                        # optional: per-pair overrides
      - {between: [0, 7], bandwidth: 1Gbps, latency: 100us}
    algorithm: auto               # all-reduce by ring, tree, hierarchical, or auto (fastest per size)
    emulate: true                 # local clusters: each collective also takes its modelled time
    collectives:                  # or the fits directly (`hap profile` measures them)
      all_reduce: {alpha: 2e-4, beta: 7.4e8}
      all_gather: {alpha: 1e-4, beta: 1.5e9}
      reduce_scatter: {alpha: 1e-4, beta: 1.5e9}
      all_to_all: {alpha: 1e-4, beta: 1.5e9}
      broadcast: {alpha: 5e-5, beta: 1.2e9}

A link's latency, where not given, is 0 (a bandwidth alone: every message priced by its bytes).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..ir import size_text
from .topology import ALGORITHMS, Link, Machine, Topology, uniform

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
COLLECTIVES: tuple[Collective, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
REFERENCE_BYTES = 1 << 20  # the size at which the fastest algorithm is chosen for a fixed fit


class ClusterError(ValueError):
    """A malformed cluster file or spec; the message names the problem."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    name: str
    """Label shown in plans, e.g. 'v100'."""
    flops: float
    """Achieved FLOP/s of one GPU (profiled, not the datasheet peak)."""
    memory: float
    """Bytes of memory of one GPU."""
    gpus: int = 1
    """GPUs in this virtual device (a machine); they run data parallel inside it."""
    intra_bandwidth: float = 0.0
    """Bytes/s between the GPUs of a machine (all-reduce bus bandwidth); needed when gpus > 1."""
    mem_bandwidth: float = 0.0
    """Bytes/s of GPU memory, to cost memory-bound ops; 0 leaves them uncosted."""
    slowdown: float = 1.0
    """For emulated local devices: computation is stretched by this factor (1 = none)."""
    op_overhead: float = 0.0
    """Seconds every node costs per pass whatever its size (framework dispatch, kernel launch);
    dominant for small models on CPUs, which is where `hap profile` measures it."""

    @property
    def total_flops(self) -> float:
        return self.flops * self.gpus


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    alpha: float
    """Seconds of latency per collective call."""
    beta: float
    """Bytes of volume per second."""

    def time(self, volume: float) -> float:
        return self.alpha + volume / self.beta


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    collectives: dict[str, Fit] = field(default_factory=dict)
    """One fit per name in COLLECTIVES."""
    local: bool = False
    """Its devices are processes on this machine (the built-in local clusters, files `hap profile`
    writes, files that say `local: true`): what `hap train` runs without being told to emulate."""
    emulated_network: tuple[float, float] | None = None
    """(bandwidth bytes/s, latency s) that the local runtime emulates on every collective by
    sleeping (`network: {..., emulate: true}`); None: links run at this machine's speed."""
    topology: Topology | None = None
    """Machines, network cards and links (from `machines:` or `network:`); None where the file
    gives only measured collective fits."""
    emulate_links: bool = False
    """The local runtime makes each collective take the topology's time too (`emulate: true`)."""
    measured_fits: bool = False
    """The file gives the collectives' fits itself (`collectives:`, measured): they win over the
    topology's."""

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def gpus(self) -> int:
        return sum(d.gpus for d in self.devices)

    def fit(self, name: Collective) -> Fit:
        return self.collectives[name]

    def fit_at(self, name: Collective, nbytes: float) -> Fit:
        """The fit of collective `name` on nbytes over all devices: with a topology whose
        all-reduce algorithm is "auto", the fastest algorithm's for that size."""
        if self.topology is not None and name == "all_reduce" and self.topology.algorithm == "auto" \
                and not self.measured_fits:
            return topology_fit(self.topology, name, range(self.size), nbytes)
        return self.collectives[name]

    def all_reduce_fits(self) -> list[Fit]:
        """Every fit `fit_at("all_reduce", n)` may return, whatever n."""
        if self.topology is not None and self.topology.algorithm == "auto" and not self.measured_fits:
            group = range(self.size)
            return [Fit(alpha=a, beta=1 / b if b > 0 else math.inf)
                    for a, b in (self.topology.coefficients("all_reduce", group, alg) for alg in ALGORITHMS)]
        return [self.collectives["all_reduce"]]

    @property
    def machines(self) -> tuple[tuple[int, ...], ...]:
        """The devices of every machine (each device its own where the cluster names none)."""
        if self.topology is None:
            return tuple((d,) for d in range(self.size))
        return tuple(tuple(m.devices) for m in self.topology.machines)

    def compute_proportional(self) -> list[float]:
        total = sum(d.total_flops for d in self.devices)
        return [d.total_flops / total for d in self.devices]

    def even(self) -> list[float]:
        return [1.0 / self.size] * self.size

    def describe(self) -> str:
        groups: list[list] = []
        for d in self.devices:
            if groups and groups[-1][0] == d:
                groups[-1][1] += 1
            else:
                groups.append([d, 1])
        def speed(flops: float) -> str:  # (a 3 GFLOP/s device said 0.00 TFLOP/s)
            return f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e10 else f"{flops / 1e9:.3g} GFLOP/s"

        parts = [f"{n} x {d.name} ({d.gpus} GPU{'s' if d.gpus > 1 else ''}, {speed(d.flops)}, "
                 f"{size_text(d.memory)})" for d, n in groups]
        return f"{self.name}: {self.size} devices, {self.gpus} GPUs: " + ", ".join(parts)

    def to_dict(self) -> dict:
        """The spec as a cluster file would give it (cluster_from_dict reads it back)."""
        out = {
            "name": self.name,
            "devices": [{k: _unit_where_needed(k, getattr(d, k)) for k in Device.__slots__} for d in self.devices],
        }
        if self.topology is not None and self.size > 1:
            link = lambda x: {"bandwidth": _unit_where_needed("bandwidth", x.bandwidth),  # noqa: E731
                              "latency": _unit_where_needed("latency", x.latency)}
            out["machines"] = [{"name": m.name, "devices": len(m.devices), "intra": link(m.intra), "nic": link(m.nic)}
                               for m in self.topology.machines]
            out["links"] = [{"between": [a, b], **link(x)} for a, b, x in self.topology.overrides]
            out["algorithm"] = self.topology.algorithm
        # (a topology's or a network's fits follow from it; one device has none: infinite betas,
        # which JSON cannot hold and a cluster file may not give)
        if (self.measured_fits or self.topology is None) and self.size > 1:
            out["collectives"] = {k: {"alpha": _unit_where_needed("alpha", f.alpha), "beta": _unit_where_needed("beta", f.beta)}
                                  for k, f in self.collectives.items()}
        if self.emulate_links and "machines" in out:  # (one device has no links to emulate)
            out["emulate"] = True
        if self.emulated_network is not None:
            bandwidth, latency = self.emulated_network
            out["network"] = {"bandwidth": _unit_where_needed("bandwidth", bandwidth),
                              "latency": _unit_where_needed("latency", latency), "emulate": True}
            out.pop("machines", None), out.pop("links", None), out.pop("algorithm", None)
        if self.local:
            out["local"] = True
        return out


def _unit_where_needed(key: str, value):
    """A cluster file's value as to_dict writes it: a bare number in the base unit, as ever,
    but with its unit where the loader would take the bare number for a forgotten unit
    (_given_unit: a latency of a second or more, a bandwidth under 1 kB/s)."""
    if key == "memory" and isinstance(value, float) and value.is_integer():
        return int(value)  # (bytes: 17179869184, not 17179869184.0)
    plausible, unit = _BARE_RANGE.get(key, (None, None))
    if plausible is None or not isinstance(value, float) or value <= 0 or plausible[0] <= value < plausible[1]:
        return value
    return f"{value!r}{unit}"


def fits_from_network(m: int, bandwidth: float, latency: float) -> dict[str, Fit]:
    """Ring-algorithm fits for m devices joined by links of `bandwidth` bytes/s and `latency` s
    (each device its own machine): the topology's pricing, cost/topology.py.

    With shard size s (bytes) and volume defined as in cost/model.py:
      all-reduce of n bytes:       2(m-1)/m * n / bw      -> beta = bw * m / (2(m-1))
      all-gather, reduce-scatter,
      volume m*s:                  (m-1) * s / bw         -> beta = bw * m / (m-1)
      all-to-all, volume m*s:      (m-1) / m * s / bw     -> beta = bw * m^2 / (m-1)
      broadcast of n bytes (pipelined chain): n / bw      -> beta = bw
    """
    return fits_from_topology(uniform(max(m, 1), bandwidth, latency))


def topology_fit(topology: Topology, kind: str, group, nbytes: float = REFERENCE_BYTES) -> Fit:
    """The (alpha, beta) of collective `kind` over `group` by the algorithm fastest at nbytes."""
    group = list(group)
    algorithm, _ = topology.best(kind, nbytes, group)
    alpha, per_byte = topology.coefficients(kind, group, algorithm)
    return Fit(alpha=alpha, beta=1 / per_byte if per_byte > 0 else math.inf)


def fits_from_topology(topology: Topology) -> dict[str, Fit]:
    """Fits of every collective over all the topology's devices."""
    return {k: topology_fit(topology, k, range(topology.size)) for k in COLLECTIVES}


# ---------------------------------------------------------------------------------------------
# Parsing and validation


_PREFIXES = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class _DataUnits:
    """Bytes (sizes) or bytes per second (rates) in a unit: B is a byte and b a bit, whatever
    the case of the prefix and of "ps" (Gbps and Gb/s are bits, GB/s and GBps bytes; a size in
    bits is refused). The case of b decided nothing before: Gb/s was read as bytes, GBps as bits."""

    def __init__(self, rate: bool):
        self.rate = rate

    def factor(self, unit: str) -> float | None:
        m = re.fullmatch(r"([kmgt]i?)?([bB])(ps|/s)?", _lower_but_b(unit))
        if m is None or (m.group(3) is not None) != self.rate or (m.group(2) == "b" and not self.rate):
            return None
        return _PREFIXES[m.group(1) or ""] / (8 if m.group(2) == "b" else 1)

    def __str__(self) -> str:
        return ("Gbps or Gb/s (bits), GB/s or GBps (bytes), with k, M, G, T, Ki, Mi, Gi prefixes" if self.rate
                else "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB")


def _lower_but_b(unit: str) -> str:
    """`unit` in lower case but for its b or B (the one before "ps", "/s" or the end)."""
    m = re.fullmatch(r"(.*?)([bB])((?:ps|/s)?)", unit, flags=re.IGNORECASE)
    return unit.lower() if m is None else m.group(1).lower() + m.group(2) + m.group(3).lower()


_SIZE_UNITS = _DataUnits(rate=False)
_RATE_UNITS = _DataUnits(rate=True)
_TIME_UNITS = {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_FLOP_UNITS = {"": 1, "flops": 1, "gflops": 1e9, "tflops": 1e12, "pflops": 1e15,
               "flop/s": 1, "gflop/s": 1e9, "tflop/s": 1e12, "pflop/s": 1e15}  # (hap clusters prints TFLOP/s)


def _quantity(value, units: "dict[str, float] | _DataUnits", what: str) -> float:
    if isinstance(value, bool):
        raise ClusterError(f"{what}: expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:
            raise ClusterError(f"{what}: a number of {len(str(abs(value)))} digits is out of range") from None
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z/]*)\s*", value)
        if m:
            unit = m.group(2)
            try:
                number = float(m.group(1))
            except ValueError:
                number = None
            factor = 1.0 if not unit else units.factor(unit) if isinstance(units, _DataUnits) else units.get(unit.lower())
            if number is not None and factor is not None:  # YAML reads 4e-4 as a string
                return number * factor
    allowed = units if isinstance(units, _DataUnits) else ", ".join(u for u in units if u)
    raise ClusterError(f"{what}: cannot read {value!r} (a number, or a number with a unit: {allowed})")


SANE = (1e-30, 1e30)
"""Every positive quantity of a cluster lies in this range: beyond it lies a typo, and prices
that overflow (a bandwidth of 1e-320 made 1 / bandwidth infinite, flops of 1e308 an infinite
total)."""


def _positive(x: float, what: str, allow_zero: bool = False) -> float:
    if math.isnan(x) or x < 0 or (x == 0 and not allow_zero):
        raise ClusterError(f"{what} must be {'non-negative' if allow_zero else 'positive'}, got {x:g}")
    if x != 0 and not SANE[0] <= x <= SANE[1]:
        raise ClusterError(f"{what} of {x:g} is out of range ({SANE[0]:g} to {SANE[1]:g} in its unit's base)")
    return x


BARE_BANDWIDTH = (1e3, math.inf)
"""Bytes/s a bandwidth given as a bare number may be (below: a unit forgotten)."""
BARE_LATENCY = (0.0, 1.0)
"""Seconds a latency given as a bare number may be (a second or more: a unit forgotten)."""
BARE_FLOPS = (1e6, math.inf)
"""FLOP/s a device's speed given as a bare number may be ("flops: 15" meant 15 TFLOPS)."""


_BARE_RANGE = {key: (BARE_BANDWIDTH, "B/s") for key in ("bandwidth", "beta", "intra_bandwidth", "mem_bandwidth")} | \
    {key: (BARE_LATENCY, "s") for key in ("latency", "alpha", "op_overhead")} | {"flops": (BARE_FLOPS, "FLOP/s")}
"""Per key of a cluster file, the range of a bare number (_given_unit) and its base unit."""


def _given_unit(value, what: str, key: str, example: str) -> None:
    """A ClusterError for a bare number outside `plausible` in the base unit (bytes/s, seconds):
    its unit was forgotten ("bandwidth: 10" read as 10 bytes/s, "latency: 30" as 30 s, as
    "memory: 16" read as 16 bytes). key: the file's key, whose range _BARE_RANGE holds."""
    plausible = _BARE_RANGE[key][0]
    if isinstance(value, str):  # YAML reads 3e1 and '30' as text: bare numbers too
        try:
            value = float(value)
        except ValueError:
            return  # a number with its unit (or unreadable: _quantity says so)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    try:
        value = float(value)
    except OverflowError:
        return  # a whole number of hundreds of digits: _quantity says it is out of range
    if not math.isfinite(value):
        raise ClusterError(f"{what} must be a finite number, got {value!r}")
    if value <= 0:
        return  # _positive says what is wrong with it (a negative number lacks more than a unit)
    if not plausible[0] <= value < plausible[1]:
        raise ClusterError(f"{what} of {value:g} with no unit; give one (say {example})")


MAX_DEVICES = 1024  # more is a typo here, not a cluster (pricing the collectives of 1024 takes half a minute)
_DEVICE_KEYS = {"name", "count", "flops", "memory", "gpus", "intra_bandwidth", "mem_bandwidth", "slowdown", "op_overhead"}


def _parse_device(spec, i: int) -> list[Device]:
    where = f"devices[{i}]"
    if not isinstance(spec, dict):
        raise ClusterError(f"{where}: expected a mapping with name, flops, memory; got {spec!r}")
    unknown = set(spec) - _DEVICE_KEYS
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_DEVICE_KEYS)}")
    for key in ("flops", "memory"):
        if key not in spec:
            raise ClusterError(f"{where}: missing '{key}'")
    name = spec.get("name", f"device{i}")
    if not isinstance(name, (str, int)) or isinstance(name, bool):  # name: null became a device called None
        raise ClusterError(f"{where}: name must be text, got {name!r}")
    name = str(name)
    count = spec.get("count", 1)
    gpus = spec.get("gpus", 1)
    for key, v in (("count", count), ("gpus", gpus)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_DEVICES:
            raise ClusterError(f"{where} ({name}): {key} must be an integer from 1 to {MAX_DEVICES}, got {v!r}")
    for key, example in (("flops", "15TFLOPS"), ("intra_bandwidth", "100GB/s"), ("mem_bandwidth", "900GB/s"), ("op_overhead", "10us")):
        _given_unit(spec.get(key, 0), f"{where} ({name}) {key}", key, example)
    dev = Device(
        name=name,
        flops=_positive(_quantity(spec["flops"], _FLOP_UNITS, f"{where}.flops"), f"{where} ({name}) flops"),
        memory=_positive(_quantity(spec["memory"], _SIZE_UNITS, f"{where}.memory"), f"{where} ({name}) memory"),
        gpus=gpus,
        intra_bandwidth=_positive(_quantity(spec.get("intra_bandwidth", 0), _RATE_UNITS, f"{where}.intra_bandwidth"),
                                  f"{where} ({name}) intra_bandwidth", allow_zero=True),
        mem_bandwidth=_positive(_quantity(spec.get("mem_bandwidth", 0), _RATE_UNITS, f"{where}.mem_bandwidth"),
                                f"{where} ({name}) mem_bandwidth", allow_zero=True),
        slowdown=_positive(_quantity(spec.get("slowdown", 1.0), {"": 1, "x": 1}, f"{where}.slowdown"),
                           f"{where} ({name}) slowdown"),
        op_overhead=_positive(_quantity(spec.get("op_overhead", 0), _TIME_UNITS | {"": 1}, f"{where}.op_overhead"),
                              f"{where} ({name}) op_overhead", allow_zero=True),
    )
    if dev.memory < 2**10:  # "memory: 16" means 16 bytes: a unit forgotten
        raise ClusterError(f"{where} ({name}): memory of {dev.memory:g} bytes is less than 1 KiB; give a unit "
                           "(say 16GiB)")
    if dev.slowdown < 1:
        raise ClusterError(f"{where} ({name}): slowdown must be at least 1 (it stretches this machine's speed), "
                           f"got {dev.slowdown:g}")
    if dev.gpus > 1 and dev.intra_bandwidth <= 0:
        raise ClusterError(f"{where} ({name}): a machine of {dev.gpus} GPUs needs intra_bandwidth")
    return [dev] * count


def cluster_from_dict(spec, default_name: str = "cluster") -> Cluster:
    if not isinstance(spec, dict):
        raise ClusterError(f"a cluster spec is a mapping with 'devices'; got {type(spec).__name__}")
    allowed = ("name", "devices", "network", "machines", "links", "algorithm", "emulate", "collectives", "local")
    unknown = set(spec) - set(allowed)
    if unknown:
        raise ClusterError(f"unknown top-level key(s) {sorted(unknown)}; allowed: {', '.join(allowed)}")
    for key in ("local", "emulate"):
        if not isinstance(spec.get(key, False), bool):
            raise ClusterError(f"{key} must be true or false, got {spec[key]!r}")
    devs_spec = spec.get("devices")
    if not isinstance(devs_spec, list) or not devs_spec:
        raise ClusterError("'devices' must be a non-empty list")
    devices = tuple(d for i, s in enumerate(devs_spec) for d in _parse_device(s, i))
    if len(devices) > MAX_DEVICES:
        raise ClusterError(f"'devices' lists {len(devices)} devices; hap plans for {MAX_DEVICES} at most")
    fits: dict[str, Fit] = {}
    emulated = topology = None
    given = spec.get("collectives")  # measured fits (an empty section is none)
    given = {} if given is None else given
    if "network" in spec and "machines" in spec:
        raise ClusterError("give 'network' (every device its own machine) or 'machines', not both")
    if "machines" in spec:
        topology = _parse_topology(spec, len(devices))
        fits.update(fits_from_topology(topology))
    elif "links" in spec or "algorithm" in spec:
        raise ClusterError("'links' and 'algorithm' describe 'machines': give those too")
    if "network" in spec:
        net = spec["network"]
        if not isinstance(net, dict) or "bandwidth" not in net:
            raise ClusterError("'network' needs a bandwidth (e.g. {bandwidth: 10Gbps, latency: 30us})")
        unknown = set(net) - {"bandwidth", "latency", "emulate"}
        if unknown:
            raise ClusterError(f"network: unknown key(s) {sorted(unknown)}; allowed: bandwidth, latency, emulate")
        _given_unit(net["bandwidth"], "network.bandwidth", "bandwidth", "10Gbps")
        _given_unit(net.get("latency", 0), "network.latency", "latency", "30us")
        bw = _positive(_quantity(net["bandwidth"], _RATE_UNITS, "network.bandwidth"), "network bandwidth")
        lat = _positive(_quantity(net.get("latency", 0), _TIME_UNITS, "network.latency"), "network latency", allow_zero=True)
        if not isinstance(net.get("emulate", False), bool):
            raise ClusterError(f"network.emulate must be true or false, got {net['emulate']!r}")
        if net.get("emulate", False):
            emulated = (bw, lat)
        if not given or not net.get("emulate", False):
            fits.update(fits_from_network(len(devices), bw, lat))
        topology = uniform(len(devices), bw, lat)
    if not isinstance(given, dict):
        raise ClusterError(f"'collectives' must map each collective to {{alpha, beta}}, got {spec['collectives']!r}")
    for key, f in given.items():
        if key not in COLLECTIVES:
            raise ClusterError(f"collectives: unknown collective '{key}'; known: {', '.join(COLLECTIVES)}")
        if not isinstance(f, dict) or set(f) != {"alpha", "beta"}:
            raise ClusterError(f"collectives.{key}: expected {{alpha: seconds, beta: bytes/s}}, got {f!r}")
        _given_unit(f["alpha"], f"collectives.{key}.alpha", "alpha", "30us")
        _given_unit(f["beta"], f"collectives.{key}.beta", "beta", "10Gbps")
        fits[key] = Fit(alpha=_positive(_quantity(f["alpha"], _TIME_UNITS, f"collectives.{key}.alpha"), f"{key} alpha", allow_zero=True),
                        beta=_positive(_quantity(f["beta"], _RATE_UNITS, f"collectives.{key}.beta"), f"{key} beta"))
    if given and topology is not None and set(given) != set(COLLECTIVES) and len(devices) > 1:
        # measured fits price every collective of the plan in place of the topology: all or none
        raise ClusterError(f"collectives: give all of {', '.join(COLLECTIVES)} (as measured: hap profile writes them) "
                           f"or none ({'the machines price' if 'machines' in spec else 'the network prices'} them); missing: "
                           f"{', '.join(k for k in COLLECTIVES if k not in given)}")
    missing = [k for k in COLLECTIVES if k not in fits]
    if missing and len(devices) > 1:
        raise ClusterError(f"no cost for collective(s) {', '.join(missing)}: give 'network' or 'collectives'")
    if len(devices) == 1:
        fits = fits_from_network(1, 1.0, 0.0)
    if spec.get("emulate", False) and topology is None:
        raise ClusterError("emulate: true needs 'machines' or 'network' to say what to emulate")
    return Cluster(name=_name(spec.get("name", default_name), "name"), devices=devices, collectives=fits,
                   local=spec.get("local", False), emulated_network=emulated, topology=topology,
                   emulate_links=spec.get("emulate", False), measured_fits=bool(given))


def _name(value, what: str) -> str:
    """A name given as text (or a number); `name:` left empty became a cluster called None."""
    if not isinstance(value, (str, int)) or isinstance(value, bool) or not str(value).strip():
        raise ClusterError(f"{what} must be text, got {value!r}")
    return str(value)


def _parse_link(spec, where: str, default: Link | None = None) -> Link:
    if spec is None and default is not None:
        return default
    if not isinstance(spec, dict) or "bandwidth" not in spec or set(spec) - {"bandwidth", "latency"}:
        raise ClusterError(f"{where}: expected {{bandwidth: ..., latency: ...}}, got {spec!r}")
    _given_unit(spec["bandwidth"], f"{where}.bandwidth", "bandwidth", "10Gbps")
    _given_unit(spec.get("latency", 0), f"{where}.latency", "latency", "30us")
    return Link(bandwidth=_positive(_quantity(spec["bandwidth"], _RATE_UNITS, f"{where}.bandwidth"), f"{where} bandwidth"),
                latency=_positive(_quantity(spec.get("latency", 0), _TIME_UNITS, f"{where}.latency"), f"{where} latency",
                                  allow_zero=True))


def _parse_topology(spec: dict, n: int) -> Topology:
    machines_spec = spec["machines"]
    if not isinstance(machines_spec, list) or not machines_spec:
        raise ClusterError("'machines' must be a non-empty list of {name, devices, intra, nic}")
    machines, first = [], 0
    for i, m in enumerate(machines_spec):
        where = f"machines[{i}]"
        if not isinstance(m, dict) or set(m) - {"name", "devices", "intra", "nic"} or "nic" not in m:
            raise ClusterError(f"{where}: expected {{name, devices: count, intra: link, nic: link}}, got {m!r}")
        count = m.get("devices", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_DEVICES:
            raise ClusterError(f"{where}: devices must be a count from 1 to {MAX_DEVICES}, got {count!r}")
        nic = _parse_link(m["nic"], f"{where}.nic")
        if count > 1 and m.get("intra") is None:  # (`intra:` left empty took the network card's)
            raise ClusterError(f"{where}: a machine of {count} devices needs 'intra' (the link between them)")
        name = _name(m.get("name", f"machine{i}"), f"{where}.name")
        if any(x.name == name for x in machines):
            raise ClusterError(f"{where}: machine name {name!r} is given twice")
        machines.append(Machine(name=name, devices=tuple(range(first, first + count)),
                                intra=_parse_link(m.get("intra"), f"{where}.intra", nic), nic=nic))
        first += count
    if first != n:
        raise ClusterError(f"the machines hold {first} devices but 'devices' lists {n}")
    overrides = []
    links = spec.get("links")
    links = [] if links is None else links  # (`links:` left empty: none)
    if not isinstance(links, list):
        raise ClusterError(f"'links' must be a list of {{between: [a, b], bandwidth, latency}}, got {links!r}")
    for i, e in enumerate(links):
        where = f"links[{i}]"
        pair = e.get("between") if isinstance(e, dict) else None
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] != pair[1]
                and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < n for d in pair)):
            raise ClusterError(f"{where}: 'between' must name two different devices 0..{n - 1}, got {pair!r}")
        if any({a, b} == set(pair) for a, b, _ in overrides):
            raise ClusterError(f"{where}: the link between devices {pair[0]} and {pair[1]} is given twice")
        overrides.append((pair[0], pair[1], _parse_link({k: v for k, v in e.items() if k != "between"}, where)))
    algorithm = spec.get("algorithm", "auto")
    if algorithm not in (*ALGORITHMS, "auto"):
        raise ClusterError(f"algorithm must be one of {', '.join((*ALGORITHMS, 'auto'))}, got {algorithm!r}")
    return Topology(machines=tuple(machines), overrides=tuple(overrides), algorithm=algorithm)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (the last one won, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (<<: *anchor: keys given here override it)
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where ("while parsing a flow mapping"
    alone named neither)."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if not problem:
        return str(e).splitlines()[0]
    return problem + (f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "")


def load_cluster(path_or_name: str | Path) -> Cluster:
    """A built-in cluster by name, or a YAML file by path."""
    if not isinstance(path_or_name, (str, Path)) or not str(path_or_name).strip():
        # (a dict said "no cluster named '{'devices': []}'", "" ". is a directory")
        raise ClusterError(f"load_cluster takes a built-in cluster's name or a YAML file's path, got {path_or_name!r} "
                           "(a cluster as a dict: hap.cost.cluster.cluster_from_dict)")
    text = str(path_or_name)
    if text in BUILTIN:
        return BUILTIN[text]()
    path = Path(text)
    if not path.exists():
        raise ClusterError(f"no cluster named '{text}' and no such file; built in: {', '.join(sorted(BUILTIN))}")
    if path.is_dir():
        raise ClusterError(f"{path} is a directory, not a cluster file")
    try:
        spec = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError:
        raise ClusterError(f"{path}: not a text file (a YAML cluster file is UTF-8 text)") from None
    except OSError as e:
        raise ClusterError(f"{path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ClusterError(f"{path}: not valid YAML ({_yaml_problem(e)})") from None
    try:
        return cluster_from_dict(spec, default_name=path.stem)
    except ClusterError as e:
        raise ClusterError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Built-in clusters


GiB = 2**30
V100 = dict(flops=3.86e12, memory=16 * GiB, mem_bandwidth=900e9, intra_bandwidth=100e9)  # NVLink machine
P100 = dict(flops=2.15e12, memory=16 * GiB, mem_bandwidth=732e9, intra_bandwidth=10e9)  # PCIe machine
PAPER_BANDWIDTH = 10.4e9 / 8  # 10.4 Gbps between machines (iperf3, HAP section 7.1)
PAPER_LATENCY = 30e-6


def paper_cluster(gpus: int, heterogeneous: bool) -> Cluster:
    """The HAP testbed: 8 machines (2 V100 + 6 P100, or 8 P100), gpus/8 GPUs used in each.

    FLOP/s are the published artifact's profiled values (2 x 3.86e12 + 6 x 2.15e12).
    """
    if gpus % 8:
        raise ClusterError(f"paper clusters span 8 machines: gpus must be a multiple of 8, got {gpus}")
    per = gpus // 8
    kinds = [("v100", V100)] * 2 + [("p100", P100)] * 6 if heterogeneous else [("p100", P100)] * 8
    devices = tuple(Device(name=n, gpus=per, **spec) for n, spec in kinds)
    label = "hetero" if heterogeneous else "homo"
    return Cluster(name=f"paper-{label}-{gpus}", devices=devices,
                   collectives=fits_from_network(len(devices), PAPER_BANDWIDTH, PAPER_LATENCY),
                   topology=uniform(len(devices), PAPER_BANDWIDTH, PAPER_LATENCY))


def local_cluster(slowdowns: tuple[float, ...], name: str) -> Cluster:
    """Local CPU processes on this machine (one torch thread each), slow ones emulated.

    Typical values from `hap profile` on a 2-core machine (2026-11): ~90 GFLOP/s and ~60 GB/s
    per core, ~10 us of executor overhead per node and pass (more on an emulated device, whose
    bookkeeping is stretched too), gloo collectives of 0.2-1 ms latency. Profile for yours.
    """
    devices = tuple(Device(name=f"cpu{i}" + (f"/{s:g}x" if s != 1 else ""), flops=9e10 / s, memory=4 * GiB,
                           mem_bandwidth=6e10 / s, op_overhead=1e-5 * (2 * s - 1), slowdown=s)
                    for i, s in enumerate(slowdowns))
    if len(devices) == 1:
        return Cluster(name=name, devices=devices, collectives=fits_from_network(1, 1.0, 0.0), local=True)
    fits = {"all_reduce": Fit(alpha=4.5e-4, beta=1.0e9), "all_gather": Fit(alpha=4e-4, beta=1.4e9),
            "reduce_scatter": Fit(alpha=1e-3, beta=1.5e9), "all_to_all": Fit(alpha=3e-4, beta=3e9),
            "broadcast": Fit(alpha=2.2e-4, beta=2e9)}
    return Cluster(name=name, devices=devices, collectives=fits, local=True, measured_fits=True)


BUILTIN = {
    **{f"paper-hetero-{n}": (lambda n=n: paper_cluster(n, True)) for n in (8, 16, 24, 32, 64)},
    **{f"paper-homo-{n}": (lambda n=n: paper_cluster(n, False)) for n in (8, 16, 24, 32, 64)},
    "local": lambda: local_cluster((1.0, 3.0), "local"),
    "local-homo": lambda: local_cluster((1.0, 1.0), "local-homo"),
    "local-4": lambda: local_cluster((1.0, 1.0, 2.0, 3.0), "local-4"),
}
