"""Emulated heterogeneity on the local cluster: slower devices and slower links, by sleeping.

A device marked `slowdown: s` in the cluster file runs every node at this machine's speed and
then owes (s - 1) times the node's measured time (twice that for its backward, which costs
about two forwards): the method of seed 002, which stretches measured compute time. The debt
is paid, by sleeping, just before the rank's next collective, which is where a slow device
makes the others wait. Paying once per collective instead of once per node keeps the sleeps
long enough for the OS timer to honour them (a sleep of a few microseconds takes ~60 us).

A cluster that says `emulate: true` (at the top, with `machines`, or in its `network`) also
makes each collective take its modelled link time (latency + volume / bandwidth, priced on the
cluster's topology over the collective's device group by its slowest link,
hap/cost/topology.py) on top of its real time here. A rank's link carries one collective at a
time: one started while another is still on the wire waits for it, and an asynchronous one
(gradient sync) runs its link time while the rank computes, ending no earlier than it would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..cost.cluster import Cluster
from ..cost.topology import Topology, uniform


@dataclass(slots=True, kw_only=True)
class Emulation:
    slowdown: float = 1.0
    """This rank's device is this many times slower than the machine (1: not emulated)."""
    links: Topology | None = None
    """The links whose times collectives take on top of their own; None: not emulated."""
    devices: int = 1
    debt: float = 0.0
    """Seconds of emulated compute not yet slept (negative: overslept, credited)."""
    wire_free: float = 0.0
    """When (time.perf_counter) this rank's link is done with the collectives started so far."""

    def __post_init__(self):
        if not self.slowdown >= 1:  # (it stretches this machine's speed: it cannot make it faster)
            raise ValueError(f"slowdown must be at least 1, got {self.slowdown:g}")

    @classmethod
    def for_rank(cls, cluster: Cluster, rank: int) -> "Emulation":
        # every rank checks every device: a rank refusing its own alone left the others waiting
        slow = next((j for j, d in enumerate(cluster.devices) if not d.slowdown >= 1), None)
        if slow is not None:
            raise ValueError(f"device {slow} ({cluster.devices[slow].name}) of cluster {cluster.name!r}: slowdown must be "
                             f"at least 1 (it stretches this machine's speed), got {cluster.devices[slow].slowdown:g}")
        links = None
        if cluster.emulated_network is not None:
            links = uniform(cluster.size, *cluster.emulated_network)
        elif cluster.emulate_links:
            links = cluster.topology
        return cls(slowdown=cluster.devices[rank].slowdown, links=links, devices=cluster.size)

    def computed(self, seconds: float, passes: float = 1.0) -> None:
        """This rank just spent `seconds` computing `passes` forward-equivalents at full speed."""
        self.debt += (self.slowdown - 1) * seconds * passes

    def settle(self) -> None:
        """Sleep off the compute debt (before a collective)."""
        if self.debt > 0:
            t0 = time.perf_counter()
            with torch.profiler.record_function("emulated slowdown"):  # visible in traces
                time.sleep(self.debt)
            self.debt -= time.perf_counter() - t0

    def on_wire(self, kind: str, volume: float, devices=None, occupies: bool = True) -> float:
        """A collective of `volume` bytes (as the cost model defines it) over `devices` (None:
        all) starts on this rank's link: when its link time is over. occupies=False: a few bytes
        whose time is latency (a count), which the collectives after it do not queue behind."""
        if self.links is None:
            return 0.0
        seconds = self.links.run_seconds(kind, volume, range(self.devices) if devices is None else devices)
        return self.occupy(seconds) if occupies else time.perf_counter() + seconds

    def occupy(self, seconds: float) -> float:
        """This rank's link carries `seconds` of transfers (a collective, a pipeline's messages)
        after what it carries already: when they are over."""
        self.wire_free = max(time.perf_counter(), self.wire_free) + seconds
        return self.wire_free

    def off_wire(self, ready_at: float) -> None:
        """The collective is done here: wait out what is left of its link time."""
        left = ready_at - time.perf_counter()
        if left > 0:
            with torch.profiler.record_function("emulated link"):
                time.sleep(left)

    def communicated(self, kind: str, volume: float) -> None:
        """A blocking collective of `volume` bytes over all devices just finished."""
        self.off_wire(self.on_wire(kind, volume))
