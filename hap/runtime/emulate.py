"""Emulated heterogeneity on the local cluster: slower devices and slower links, by sleeping.

A device marked `slowdown: s` in the cluster file runs every node at this machine's speed and
then owes (s - 1) times the node's measured time (twice that for its backward, which costs
about two forwards): the method of seed 002, which stretches measured compute time. The debt
is paid, by sleeping, just before the rank's next collective, which is where a slow device
makes the others wait. Paying once per collective instead of once per node keeps the sleeps
long enough for the OS timer to honour them (a sleep of a few microseconds takes ~60 us).

A cluster that says `emulate: true` (at the top, with `machines`, or in its `network`) also
makes each collective take its modelled link time (latency + volume / bandwidth, priced on the
cluster's topology by its slowest link, hap/cost/topology.py) on top of its real time here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..cost.cluster import Cluster, Fit, fits_from_network, fits_from_topology


@dataclass(slots=True, kw_only=True)
class Emulation:
    slowdown: float = 1.0
    """This rank's device is this many times slower than the machine (1: not emulated)."""
    link: dict[str, Fit] = field(default_factory=dict)
    """Extra seconds per collective kind (alpha + volume / beta); empty: links not emulated."""
    debt: float = 0.0
    """Seconds of emulated compute not yet slept (negative: overslept, credited)."""

    @classmethod
    def for_rank(cls, cluster: Cluster, rank: int) -> "Emulation":
        link = {}
        if cluster.emulated_network is not None:
            bandwidth, latency = cluster.emulated_network
            link = fits_from_network(cluster.size, bandwidth, latency)
        elif cluster.emulate_links:
            link = fits_from_topology(cluster.topology)
        return cls(slowdown=cluster.devices[rank].slowdown, link=link)

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

    def communicated(self, kind: str, volume: float) -> None:
        """A collective of `volume` bytes (as the cost model defines it) just finished."""
        if self.link:
            with torch.profiler.record_function("emulated link"):
                time.sleep(self.link[kind].time(volume))
