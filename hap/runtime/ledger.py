"""Which of hap's calls each rank is in, so that a call made on some ranks only ends the run at
once, naming both ranks' calls, rather than after the collective timeout or as a bare abort.

Every rank makes the calls that talk to all ranks (a step's forward, full_state_dict, a
checkpoint's save, clip_grad_norm_, reshard) alike and in the same order: each holds its own
part of the model. DDP's habits break that (`if rank == 0: save(...)`, an evaluation on rank 0
alone, one rank running a step more): the others wait in a collective no rank joins until the
timeout (120 s) ends the run with "stuck, slow, or in a different collective", or gloo finds
two different collectives paired and aborts the rank (SIGABRT).

Each rank numbers its calls that issue a collective over all ranks, counting a call at its
first such collective (a call that talks to no one, a full_state_dict of a model kept whole,
is a rank's own business), and its function's return as one more. Its latest KEPT calls are
written, as each is counted, to its slot of a file spawn shares with its ranks (memory-mapped:
no system call; spawn's ranks are on one machine). A thread of each rank reads its peers'
once the rank has made no new call for STILL_S: two ranks whose n-th calls differ have parted,
whatever either does next, and the rank ends the run with both calls named. spawn reads the
slots too, for a rank that died (a gloo abort), and a timeout's report says where each rank was.

    with ledger.call("dmodel.full_state_dict()"):   # counted at its first collective
        ...
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import struct
import sys
import threading
import time
import traceback
from typing import Callable

import torch.distributed as dist

KEPT = 16
"""How many of its latest calls a rank keeps in its slot: peers further apart are not compared."""

SLOT = 4096
"""Bytes per rank in the shared file: a sequence number, a length, the calls as JSON."""

STILL_S = 1.0
"""How long a rank makes no new call before it reads its peers' calls: a step's calls go by
faster in a healthy run, which then reads nothing."""

TICK_S = 0.25
"""How often the watching thread looks at its own rank's calls."""

RETURNED = "the return from its function"

_HEADER = struct.Struct("<II")  # (sequence: odd while being written, length of the JSON)


class Slots:
    """Every rank's slot of the shared file (`path`, world x SLOT bytes: `create` makes it)."""

    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), 0)
        self.world = len(self.map) // SLOT

    @staticmethod
    def create(path: str, world: int) -> None:
        with open(path, "wb") as f:
            f.truncate(world * SLOT)

    def write(self, rank: int, calls: tuple[tuple[int, str], ...]) -> None:
        data = json.dumps(calls).encode()
        while len(data) > SLOT - _HEADER.size:  # (long names: fewer calls)
            calls = calls[1:]
            data = json.dumps(calls).encode()
        at = rank * SLOT
        seq = _HEADER.unpack_from(self.map, at)[0]
        _HEADER.pack_into(self.map, at, (seq + 1) & 0xFFFFFFFF, 0)  # odd: a reader tries again
        self.map[at + _HEADER.size:at + _HEADER.size + len(data)] = data
        _HEADER.pack_into(self.map, at, (seq + 2) & 0xFFFFFFFF, len(data))

    def read(self, rank: int) -> list[tuple[int, str]]:
        """Rank `rank`'s latest calls (none written: [])."""
        at = rank * SLOT
        for _ in range(1000):
            seq, n = _HEADER.unpack_from(self.map, at)
            data = bytes(self.map[at + _HEADER.size:at + _HEADER.size + n])
            if seq % 2 == 0 and _HEADER.unpack_from(self.map, at)[0] == seq:
                return [tuple(c) for c in json.loads(data)] if n else []
            time.sleep(0.001)
        return []  # (a writer stopped half way: it died mid-write)


class Ledger:
    """This rank's calls: (number, name) of the latest KEPT, newest last, also in its slot."""

    def __init__(self, rank: int = 0, slots: Slots | None = None):
        self.rank, self.slots = rank, slots
        self.calls: tuple[tuple[int, str], ...] = ()
        self.count = 0
        self.pending: str | None = None
        """The call this rank is in and has not counted yet (no collective over all ranks so far)."""
        self.current: str | None = None
        """The call this rank is in (None: between calls)."""
        self.thread = threading.get_ident()

    def add(self, name: str) -> None:
        self.count += 1
        self.calls = (self.calls + ((self.count, name),))[-KEPT:]  # (a new tuple: the watcher reads it whole)
        if self.slots is not None:
            self.slots.write(self.rank, self.calls)


_LEDGER: Ledger | None = None
"""This rank's ledger (spawn's ranks); None: not kept."""


def keep(rank: int = 0, path: str | None = None) -> Ledger:
    """Start keeping this rank's calls (spawn does, for each rank, before its function runs), in
    its slot of the shared file at `path` (None: in this process alone)."""
    global _LEDGER
    _LEDGER = Ledger(rank, Slots(path) if path is not None else None)
    return _LEDGER


@contextlib.contextmanager
def call(name: str, now: bool = False):
    """The block is one of the calls ranks make alike: counted at its first collective over all
    ranks, or at once (`now`: a block that always issues one, whose first collectives are with
    some ranks only, a pipeline's sends). Calls within a call are part of it."""
    ledger = _LEDGER
    if ledger is None or ledger.current is not None or threading.get_ident() != ledger.thread:
        yield
        return
    ledger.current = ledger.pending = name
    if now:
        talking()
    try:
        yield
    finally:
        ledger.current = ledger.pending = None


def called(name: str, now: bool = False):
    """A decorator: each call of the function is a `call(name, now)`."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with call(name, now):
                return fn(*args, **kwargs)
        return inner
    return wrap


def rename(name: str) -> None:
    """The call this rank is in, not counted yet, goes by `name` (a path the ranks must all
    take, chosen within it: a forward of inputs other than the planned batch's)."""
    ledger = _LEDGER
    if ledger is not None and ledger.pending is not None and threading.get_ident() == ledger.thread:
        ledger.pending = name


def talking(group=None) -> None:
    """A collective over `group` (None: the default group) is about to start on this thread:
    the call it is in is counted, where the group is all ranks."""
    ledger = _LEDGER
    if ledger is None or ledger.pending is None or threading.get_ident() != ledger.thread:
        return
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        return
    ledger.add(ledger.pending)
    ledger.pending = None


def mark(name: str) -> None:
    """A call that is one moment, not a block (a backward begins), counted at once: where no
    call is open, on the rank's own thread (a GPU's backward runs on the device's: not counted)."""
    ledger = _LEDGER
    if ledger is not None and ledger.current is None and threading.get_ident() == ledger.thread:
        ledger.add(name)


def returned() -> None:
    """This rank's function returned: its last call, which its peers' unmade calls differ from."""
    if _LEDGER is not None:
        _LEDGER.add(RETURNED)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def parted(every: dict[int, list[tuple[int, str]]]) -> str | None:
    """The one-line message where two ranks' calls (every: rank -> its latest calls) differ at a
    number both have; None where all agree so far."""
    ranks = sorted(every)
    for i, a in enumerate(ranks):
        own = dict(every[a])
        for b in ranks[i + 1:]:
            for n, name in every[b]:
                if n in own and own[n] != name:
                    return (f"ranks {a} and {b} parted: rank {a}'s {_ordinal(n)} call to all ranks is {own[n]}, rank "
                            f"{b}'s {name}: every rank makes hap's collective calls alike and in the same order (each "
                            "holds its own part of the model: a call made on some ranks alone, DDP's `if rank == 0:` "
                            "habit, meets no partner)")
    return None


def read_all(path: str) -> dict[int, list[tuple[int, str]]]:
    """Every rank's latest calls, from the shared file at `path` (spawn's view after a failure)."""
    slots = Slots(path)
    return {r: slots.read(r) for r in range(slots.world)}


def whereabouts(every: dict[int, list[tuple[int, str]]]) -> str:
    """Where each rank was, for a timeout's report: each rank's last call to all ranks."""
    return "; ".join(f"rank {r}: its {_ordinal(calls[-1][0])}, {calls[-1][1]}" if calls else f"rank {r}: none yet"
                     for r, calls in sorted(every.items()))


def watch(end: Callable[[str, str], None]) -> None:
    """Start this rank's watching thread: once the rank has made no new call for STILL_S, it
    reads its peers' calls, and where two differ calls end(message, where the main thread is),
    which does not return."""
    ledger = _LEDGER
    assert ledger is not None and ledger.slots is not None

    def run():
        seen, since = ledger.calls, time.monotonic()
        while True:
            time.sleep(TICK_S)
            if ledger.calls != seen:
                seen, since = ledger.calls, time.monotonic()
                continue
            if time.monotonic() - since < STILL_S:
                continue
            every = {r: ledger.slots.read(r) for r in range(ledger.slots.world)}
            message = parted(every)
            if message is not None:
                end(message, _main_stack(ledger.thread))
            since = time.monotonic()  # (read again STILL_S later)

    threading.Thread(target=run, daemon=True, name="hap-ledger").start()


def _main_stack(ident: int) -> str:
    frame = sys._current_frames().get(ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""
