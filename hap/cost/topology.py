"""Cluster topology: machines, their network cards and links, and collectives priced on them.

A topology places the cluster's devices (in rank order) on machines. Devices of one machine
talk over its internal link (NVLink, PCIe: `intra`); devices of two machines over the slower
of their network cards (`nic`); a per-pair override replaces either (a congested or degraded
link). Every link is (bandwidth bytes/s, latency s), and a message of n bytes takes
latency + n / bandwidth.

A collective over any device group is priced by the algorithm that runs it; n is the bytes of
the whole tensor, g the group's size, and (bw, lat) the slowest link the algorithm uses:

    ring all-reduce        2(g-1) lat + 2(g-1)/g n / bw     over the ring's slowest link
    tree all-reduce        2 ceil(log2 g) (lat + n / bw)   reduce up a binary tree, broadcast down
    hierarchical all-reduce  gather the sum inside each machine onto one device, a ring all-reduce of
                           the n bytes among those (one per machine) over the NICs, and spread it
                           inside again: 2(k-1) lat_in + 2(k-1)/k n / bw_in (a reduce-scatter and an
                           all-gather over the machine's ring) + the ring all-reduce above, k the
                           most devices of the group on a machine
    ring all-gather, reduce-scatter   (g-1) lat + (g-1)/g V / bw, V = g * shard bytes
    all-to-all             (g-1) lat + (g-1)/g^2 V / bw: each device sends the g-1 parts of its
                           shard (V / g) that others take, all pairs at once, over the slowest link;
                           and no faster than a machine's card, which carries its k devices' parts
                           for the g-k elsewhere: k (g-k)/g^2 V / bw_nic
    broadcast, reduce      ceil(log2 g) lat + n / bw        (pipelined, to or from one device)
    send/recv              lat + n / bw                     over the one link

All are latency + bytes / bandwidth, so the cost model keeps its linear form (cluster.Fit);
`best` picks the algorithm that is fastest for a given size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

Algorithm = Literal["ring", "tree", "hierarchical"]
ALGORITHMS: tuple[Algorithm, ...] = ("ring", "tree", "hierarchical")
LAUNCH_OVERHEAD = 20e-6  # seconds a collective costs beyond its link latency (kernel launch, sync)


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    bandwidth: float
    """Bytes per second."""
    latency: float
    """Seconds per message."""

    def __post_init__(self):
        if not (0 < self.bandwidth < math.inf and 0 <= self.latency < math.inf):
            raise ValueError(f"a link has a positive bandwidth and a latency at least 0, got bandwidth "
                             f"{self.bandwidth!r} and latency {self.latency!r}")

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    name: str
    devices: tuple[int, ...]
    """The cluster's device indices (ranks) on this machine."""
    intra: Link
    """Between two devices of this machine."""
    nic: Link
    """This machine's network card."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    machines: tuple[Machine, ...]
    overrides: tuple[tuple[int, int, Link], ...] = ()
    """(device a, device b, link): replaces the link between a and b, both ways."""
    algorithm: Algorithm | Literal["auto"] = "auto"
    """How all-reduces run: one algorithm, or "auto", the fastest for each size."""

    _machine: dict[int, int] = field(init=False, repr=False, compare=False)
    """Device -> its machine's index (made once: a 1024-device file took 80 s of linear scans)."""
    _override: dict[tuple[int, int], Link] = field(init=False, repr=False, compare=False)
    _priced: dict[tuple, tuple[float, float]] = field(init=False, repr=False, compare=False)
    """(kind, group, algorithm) -> coefficients (a planner prices one group over and over: at
    1024 devices each all-reduce price took 2.8 s)."""

    def __post_init__(self):
        seen = sorted(d for m in self.machines for d in m.devices)
        if seen != list(range(len(seen))):
            raise ValueError(f"a topology puts every device 0..n-1 on exactly one machine, got devices {seen}")
        if self.algorithm not in (*ALGORITHMS, "auto"):
            raise ValueError(f"unknown all-reduce algorithm {self.algorithm!r}; choose {', '.join(ALGORITHMS)} or auto")
        for a, b, _ in self.overrides:
            if not (0 <= a < len(seen) and 0 <= b < len(seen)) or a == b:
                raise ValueError(f"a link override joins two different devices 0..{len(seen) - 1}, got {a} and {b}")
        object.__setattr__(self, "_machine", {d: i for i, m in enumerate(self.machines) for d in m.devices})
        object.__setattr__(self, "_override", {pair: link for x, y, link in self.overrides for pair in ((x, y), (y, x))})
        object.__setattr__(self, "_priced", {})

    @property
    def size(self) -> int:
        return sum(len(m.devices) for m in self.machines)

    def machine_of(self, device: int) -> int:
        found = self._machine.get(device)
        if found is None:
            raise ValueError(f"device {device} is on no machine (the cluster has {self.size})")
        return found

    def link(self, a: int, b: int) -> Link:
        """The link between devices a and b."""
        found = self._override.get((a, b))
        if found is not None:
            return found
        ma, mb = self.machines[self.machine_of(a)], self.machines[self.machine_of(b)]
        if ma is mb:
            return ma.intra
        return _slowest([ma.nic, mb.nic])

    def overridden(self, a: int, b: int) -> bool:
        """Whether a and b have a link of their own (an override), not their machines'."""
        return (a, b) in self._override

    def send(self, a: int, b: int, nbytes: float) -> float:
        """Seconds of a point-to-point send of nbytes from a to b."""
        return self.link(a, b).time(nbytes)

    def pairs_link(self, group: Sequence[int]) -> Link:
        """The slowest link between any two devices of `group`. Without overrides inside the
        group it is found from the machines, in linear time: the network cards where the group
        spans machines, the internal links where it has two devices on one; an override replaces
        its pair's link (a faster one too), so with one every pair is looked at."""
        members = set(group)
        if any(a in members and b in members for a, b, _ in self.overrides):
            return _slowest([self.link(a, b) for a in group for b in group if a < b])
        machines = self._per_machine(group)
        links = [self.machines[k].intra for k, count in machines.items() if count > 1]
        if len(machines) > 1:
            links += [self.machines[k].nic for k in machines]
        return _slowest(links)

    def _per_machine(self, group: Sequence[int]) -> dict[int, int]:
        """Machine index -> how many devices of `group` it holds."""
        count: dict[int, int] = {}
        for d in group:
            k = self.machine_of(d)
            count[k] = count.get(k, 0) + 1
        return count

    def ring_link(self, group: Sequence[int]) -> Link:
        """The slowest link of the ring through `group` in its order."""
        return _slowest([self.link(a, b) for a, b in zip(group, [*group[1:], group[0]])])

    def seconds(self, kind: str, nbytes: float, group: Sequence[int], algorithm: Algorithm = "ring") -> float:
        """Seconds of collective `kind` over `group`: nbytes is the whole tensor for all_reduce
        and broadcast, the cost model's volume V for all_gather, reduce_scatter and all_to_all."""
        alpha, per_byte = self.coefficients(kind, group, algorithm)
        return alpha + per_byte * nbytes

    def coefficients(self, kind: str, group: Sequence[int], algorithm: Algorithm = "ring") -> tuple[float, float]:
        """(seconds, seconds per byte) of the collective: its time is their linear function."""
        key = (kind, tuple(group), algorithm)
        found = self._priced.get(key)
        if found is None:
            found = self._priced[key] = self._coefficients(kind, key[1], algorithm)
        return found

    def _coefficients(self, kind: str, group: tuple[int, ...], algorithm: Algorithm) -> tuple[float, float]:
        g = len(group)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose {', '.join(ALGORITHMS)}")
        if g <= 1:
            return 0.0, 0.0
        if kind == "all_reduce":
            if algorithm == "tree":
                link, depth = self.pairs_link(group), math.ceil(math.log2(g))
                return LAUNCH_OVERHEAD + 2 * depth * link.latency, 2 * depth / link.bandwidth
            if algorithm == "hierarchical":
                return self._hierarchical(group)
            link = self.ring_link(group)
            return LAUNCH_OVERHEAD + 2 * (g - 1) * link.latency, 2 * (g - 1) / g / link.bandwidth
        if kind in ("all_gather", "reduce_scatter"):
            link = self.ring_link(group)
            return LAUNCH_OVERHEAD + (g - 1) * link.latency, (g - 1) / g / link.bandwidth
        if kind == "all_to_all":  # (an all-gather's devices each take g-1 shards; here g-1 parts of one)
            link = self.pairs_link(group)
            per_byte = (g - 1) / g / g / link.bandwidth
            # a machine's card carries its k devices' parts for the g - k elsewhere: k (g - k) / g^2 of V
            count = self._per_machine(group)
            if len(count) > 1:
                per_byte = max(per_byte, max(k * (g - k) / g / g / self.machines[i].nic.bandwidth
                                             for i, k in count.items()))
            return LAUNCH_OVERHEAD + (g - 1) * link.latency, per_byte
        if kind in ("broadcast", "reduce"):
            link = self.ring_link(group)
            return LAUNCH_OVERHEAD + math.ceil(math.log2(g)) * link.latency, 1 / link.bandwidth
        if kind in ("scatter", "gather"):  # nbytes: all the parts; the root's link carries all but its own, one by one
            link = self.ring_link(group)
            return LAUNCH_OVERHEAD + (g - 1) * link.latency, (g - 1) / g / link.bandwidth
        raise ValueError(f"unknown collective {kind!r}")

    def _hierarchical(self, group: Sequence[int]) -> tuple[float, float]:
        per_machine: dict[int, list[int]] = {}
        for d in group:
            per_machine.setdefault(self.machine_of(d), []).append(d)
        leaders = [devs[0] for devs in per_machine.values()]
        alpha, per_byte = LAUNCH_OVERHEAD, 0.0
        inside = [devs for devs in per_machine.values() if len(devs) > 1]
        if inside:  # inside each machine a reduce-scatter, and an all-gather at the end: 2 (k - 1) / k
            # of the bytes over its ring, the machines at once (each term the slowest machine's: its
            # size and its ring's link); between them the leaders all-reduce the whole tensor
            rings = [(len(devs), self.ring_link(devs)) for devs in inside]
            alpha += max(2 * (k - 1) * link.latency for k, link in rings)
            per_byte += max(2 * (k - 1) / k / link.bandwidth for k, link in rings)
        if len(leaders) > 1:
            a, b = self.coefficients("all_reduce", leaders, "ring")
            alpha += a - LAUNCH_OVERHEAD
            per_byte += b
        return alpha, per_byte

    def run_seconds(self, kind: str, nbytes: float, group: Sequence[int]) -> float:
        """Seconds of collective `kind` as the cluster runs it: all-reduce by the topology's
        algorithm (the fastest for the size where "auto"), the others as `seconds` prices them.
        The emulated links and the cost of a sync strategy both take this."""
        return self.best(kind, nbytes, group)[1] if kind == "all_reduce" else self.seconds(kind, nbytes, group)

    def best(self, kind: str, nbytes: float, group: Sequence[int]) -> tuple[Algorithm, float]:
        """The algorithm that runs the collective fastest (the topology's own, unless "auto"),
        and its seconds."""
        if kind != "all_reduce":
            return "ring", self.seconds(kind, nbytes, group)
        choices = ALGORITHMS if self.algorithm == "auto" else (self.algorithm,)
        return min(((a, self.seconds(kind, nbytes, group, a)) for a in choices), key=lambda x: x[1])

    def describe(self) -> str:
        parts = [f"{m.name}: devices {list(m.devices)}, inside {_rate(m.intra)}, network card {_rate(m.nic)}"
                 for m in self.machines]
        parts += [f"link {a}-{b}: {_rate(link)}" for a, b, link in self.overrides]
        return "; ".join(parts)


def _slowest(links: Sequence[Link]) -> Link:
    """The bottleneck of links used together: the least bandwidth and the most latency."""
    return Link(bandwidth=min(x.bandwidth for x in links), latency=max(x.latency for x in links))


def _rate(link: Link) -> str:
    return f"{link.bandwidth * 8 / 1e9:g} Gbps, {link.latency * 1e6:g} us"


def uniform(devices: int, bandwidth: float, latency: float) -> Topology:
    """Every device on its own machine, all network cards alike (today's `network:` files)."""
    nic = Link(bandwidth=bandwidth, latency=latency)
    return Topology(machines=tuple(Machine(name=f"machine{i}", devices=(i,), intra=nic, nic=nic) for i in range(devices)),
                    algorithm="ring")
