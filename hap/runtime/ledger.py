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
is a rank's own business), and its function's return as one more, and a counted call that
raised (FAILED) as one more: a refusal every rank makes is alike on all, and a rank whose call
alone raised (the model's exception on its rows, caught by the loop) ends the run, where its
peers would wait in that call's collectives or meet its next call's. Its latest KEPT calls are
written, as each is counted, to its slot of a file spawn shares with its ranks (memory-mapped:
no system call; spawn's ranks are on one machine). A thread of each rank reads its peers'
once the rank has made no new call for STILL_S: two ranks whose n-th calls differ have parted,
whatever either does next, and the rank ends the run with both calls named. spawn reads the
slots too, for a rank that died (a gloo abort), and a timeout's report says where each rank was.

Ranks that torchrun started (on one machine or several) keep their ledger in the default
process group's store instead, torchrun's agent's, which outlives every rank, from their first
call on (`StoreSlots`: each call written as it is counted, a store round trip), and a rank that
ends names its process's end there. The rank that finds two ranks parted prints both calls and
ends its process (torchrun's summary shows the message), where torch's default collective
timeout under torchrun is 30 minutes; a call of such a rank that fails in a collective because a
peer died or left (gloo aborts a rank that meets another collective than its own) raises the
parting instead, where the peers' calls show one. HAP_LEDGER=0 in the environment keeps no such
ledger. Ranks of the user's own launcher keep none: the store of their init_process_group lives
in rank 0's process and ends with it, and a peer writing to it or reading it then printed
torch's warnings of a broken pipe as a healthy run ended.

    with ledger.call("dmodel.full_state_dict()"):   # counted at its first collective
        ...
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import mmap
import os
import struct
import sys
import threading
import time
import traceback
from typing import Callable, Sequence

import torch.distributed as dist

from .. import _torch

KEPT = 16
"""How many of its latest calls a rank keeps in its slot: peers further apart are not compared."""

SLOT = 4096
"""Bytes per rank in the shared file: a sequence number, a length, the calls as JSON."""

STILL_S = 1.0
"""How long a rank makes no new call before it reads its peers' calls: a step's calls go by
faster in a healthy run, which then reads nothing."""

STORE_STILL_MAX_S = 16.0
"""The longest a store ledger's rank, still since, waits between reads of its peers' calls."""

TICK_S = 0.25
"""How often the watching thread looks at its own rank's calls."""

RETURNED = "the return from its function"

FAILED = "an exception out of its call before"
"""The entry after a counted call that raised: ranks whose calls all raised (a refusal made on
every rank) go on alike; a rank whose call alone raised, its peers still in theirs, has left
the collectives the ranks make in step (an exception of the model's own on its rows, caught)."""

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

    def read_every(self) -> dict[int, list[tuple[int, str]]]:
        return {r: self.read(r) for r in range(self.world)}


class StoreSlots:
    """Every rank's latest calls in a process group's store, under `prefix` (one per ledger:
    keys of an earlier process group in the same store are not read)."""

    def __init__(self, store, world: int, prefix: str):
        self.store, self.world = dist.PrefixStore(prefix, store), world

    def write(self, rank: int, calls: tuple[tuple[int, str], ...]) -> None:
        try:
            self.store.set(str(rank), json.dumps(calls))
        except Exception:  # (the store's host has ended: no peer is left to tell)
            pass

    def read(self, rank: int) -> list[tuple[int, str]]:
        """Rank `rank`'s latest calls (none written: [], without waiting as store.get would)."""
        if not self.store.check([str(rank)]):
            return []
        return [tuple(c) for c in json.loads(self.store.get(str(rank)))]

    def read_every(self) -> dict[int, list[tuple[int, str]]]:
        """Every rank's latest calls, in one round trip once all have written."""
        keys = [str(r) for r in range(self.world)]
        if not self.store.check(keys):
            return {r: self.read(r) for r in range(self.world)}
        return {r: [tuple(c) for c in json.loads(v)] for r, v in enumerate(self.store.multi_get(keys))}


class Ledger:
    """This rank's calls: (number, name) of the latest KEPT, newest last, also in its slot."""

    def __init__(self, rank: int = 0, slots: Slots | StoreSlots | None = None, group=None):
        self.rank, self.slots = rank, slots
        self.group = group
        """The default process group whose store keeps the calls (StoreSlots), else None."""
        self.stopped = threading.Event()
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
        if self.slots is not None:  # (before the call's collective: a peer reads it if this rank dies in it)
            self.slots.write(self.rank, self.calls)


_LEDGER: Ledger | None = None
"""This rank's ledger (spawn's ranks, or one in the default process group's store); None: not kept."""

_STARTED_FOR: object = None
"""The default process group a store ledger was last tried for (once per group)."""

_GENERATION = 0
"""Store ledgers started by this process: each writes under its own prefix."""


def keep(rank: int = 0, path: str | None = None) -> Ledger:
    """Start keeping this rank's calls (spawn does, for each rank, before its function runs), in
    its slot of the shared file at `path` (None: in this process alone)."""
    global _LEDGER
    _LEDGER = Ledger(rank, Slots(path) if path is not None else None)
    return _LEDGER


def _store_ledger() -> Ledger | None:
    """The ledger of a rank torchrun started, kept in the default process group's store (its
    agent's) from the rank's first call on: started once per process group (a group made again,
    a ledger again), watched by a thread; None where there is no group of several ranks, the
    store is not torchrun's agent's, or HAP_LEDGER=0."""
    global _LEDGER, _STARTED_FOR, _GENERATION
    ledger = _LEDGER
    if ledger is not None and ledger.group is None:  # spawn's, or one kept in this process alone
        return ledger
    world = dist.group.WORLD if dist.is_initialized() else None
    if ledger is not None and ledger.group is world:
        return ledger
    if world is None or world is _STARTED_FOR:
        return None
    if ledger is not None:  # (its group was destroyed: a new one counts afresh)
        ledger.stopped.set()
        _LEDGER = None
    _STARTED_FOR = world
    if dist.get_world_size() < 2 or os.environ.get("HAP_LEDGER", "1") == "0" or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = _torch.default_store()
    if store is None:
        return None
    _GENERATION += 1  # (and torchrun's attempt: a restarted run's ranks count afresh)
    run, attempt = os.environ.get("TORCHELASTIC_RUN_ID"), os.environ.get("TORCHELASTIC_RESTART_COUNT")
    prefix = f"hap-ledger/{run}/{attempt}/{_GENERATION}/"
    _LEDGER = ledger = Ledger(dist.get_rank(), StoreSlots(store, dist.get_world_size(), prefix), group=world)
    watch(functools.partial(_end_process, ledger.rank))
    return ledger


@atexit.register
def _process_ends() -> None:
    """A store ledger's rank names its end (a peer still in a call learns it: they parted); an
    uncaught exception is named with it."""
    ledger = _LEDGER
    if ledger is None or ledger.group is None or ledger.stopped.is_set():
        return
    ledger.stopped.set()
    error = getattr(sys, "last_value", None)
    ending = "the end of its process" + (f" on {type(error).__name__}: {error}" if error is not None else "")
    ledger.add(ending.splitlines()[0])  # (a message of several lines: its first)


def _end_process(rank: int, message: str, stack: str) -> None:
    """End this rank, its store ledger having found that it and a peer parted: the message on
    stderr (and in torchrun's error file, which its summary shows), then the process's end, as
    torch's watchdog ends a rank whose collective failed."""
    print(f"hap: rank {rank}: {message}\n\nrank {rank}'s main thread was at:\n{stack}", file=sys.stderr, flush=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
            try:
                raise RuntimeError(message)
            except RuntimeError as e:  # (raised: the file's traceback ends with the message)
                ErrorHandler().record_exception(e)
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(1)


@contextlib.contextmanager
def call(name: str, now: bool = False):
    """The block is one of the calls ranks make alike: counted at its first collective over all
    ranks, or at once (`now`: a block that always issues one, whose first collectives are with
    some ranks only, a pipeline's sends). Calls within a call are part of it."""
    ledger = _LEDGER
    if ledger is None or ledger.group is not None:
        ledger = _store_ledger()
    if ledger is None or ledger.current is not None or threading.get_ident() != ledger.thread:
        yield
        return
    if ledger.calls and ledger.calls[-1][1].startswith(FAILED):  # (before any collective of this call)
        _check_failed_alike(ledger)
    ledger.current = ledger.pending = name
    if now:
        talking()
    try:
        yield
    except Exception as e:
        why = _parting_behind(ledger, e)
        if why is not None:
            raise RuntimeError(why) from e
        if ledger.pending is None and not _collective_failed(e):  # counted: the peers are in it too, and
            ledger.add(failed_entry(e))  # may wait in its collectives (a failed collective's run ends anyway)
        raise
    finally:
        ledger.current = ledger.pending = None


_CAUGHT = ("an exception caught inside hap's call on some ranks alone leaves the collectives the ranks make in "
           "step, so the run cannot go on (let the exception end the run, or have every rank raise it)")


def failed_behind(every: dict[int, list[tuple[int, str]]], rank: int, made: int) -> str | None:
    """Where a peer's call `made` (this rank's last counted call, which it is still in) raised
    on that peer, which went on or returned (its FAILED entry): the message, in one line; else None."""
    for r, calls in sorted(every.items()):
        for n, name in calls:
            if r != rank and n == made + 1 and name.startswith(FAILED):
                called = dict(calls).get(made, "its call")
                return (f"rank {r}'s {_ordinal(made)} call to all ranks, {called}, raised "
                        f"{name.removeprefix(FAILED + ': ')} there, while rank {rank} waits in its own: " + _CAUGHT)
    return None


def failed_entry(error: BaseException) -> str:
    """The FAILED entry of `error`: its type and its message's first line, for the report."""
    said = str(error).splitlines()[0][:200] if str(error) else ""
    return f"{FAILED}: {type(error).__name__}" + (f" ({said})" if said else "")


def _alike(a: str, b: str) -> bool:
    """Two ranks' entries of one number name the same call (two FAILED entries: whatever raised)."""
    return a == b or (a.startswith(FAILED) and b.startswith(FAILED))


def _check_failed_alike(ledger: Ledger) -> None:
    """This rank's last call raised: go on only where every peer's raised too (FAILED at the
    same number, within FAILED_WAIT_S); a RuntimeError naming the call where a peer is still in
    it (its collectives would pair with this call's: gloo aborts, or the values mix) or made
    another."""
    if ledger.slots is None:
        return
    n, entry = ledger.calls[-1]
    called = dict(ledger.calls).get(n - 1, "its call")
    deadline = time.monotonic() + FAILED_WAIT_S
    while True:
        try:
            every = ledger.slots.read_every()
        except Exception:  # (a store whose host has ended: no one left to compare with)
            return
        behind = [r for r, calls in sorted(every.items()) if r != ledger.rank and (calls[-1][0] if calls else 0) < n]
        other = [(r, name) for r, calls in sorted(every.items()) for m, name in calls
                 if r != ledger.rank and m == n and not name.startswith(FAILED)]
        if other or (behind and time.monotonic() > deadline):
            peer, doing = (other[0][0], f"'s {_ordinal(n)} call to all ranks is {other[0][1]}") if other else \
                (behind[0], " is still in its own")
            raise RuntimeError(f"rank {ledger.rank}'s {_ordinal(n - 1)} call to all ranks, {called}, raised "
                               f"{entry.removeprefix(FAILED + ': ')} on this rank alone, while rank {peer}{doing}: "
                               + _CAUGHT)
        if not behind:
            return
        time.sleep(0.05)


FAILED_WAIT_S = 3.0
"""How long a store ledger's rank whose collective failed waits for its peers' calls to show a
parting (a peer that left writes its end as it exits); and a rank whose call raised, for its
peers' to have raised too (_check_failed_alike)."""


def _collective_failed(error: Exception) -> bool:
    """Whether `error` is a collective's failure (a peer died or left, gloo's timeout)."""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


def _parting_behind(ledger: Ledger, error: Exception) -> str | None:
    """Where a store ledger's call failed in a collective because a peer died or left (gloo:
    the connection closed, or a timeout), the parting the ranks' calls show within
    FAILED_WAIT_S, else None. (spawn's launcher explains its ranks' failures itself.)"""
    if ledger.group is None or not _collective_failed(error):
        return None
    deadline = time.monotonic() + FAILED_WAIT_S
    while True:
        try:
            why = parted(ledger.slots.read_every())
        except Exception:  # (the store's host has ended)
            return None
        if why is not None or time.monotonic() > deadline:
            return why
        time.sleep(0.1)


def keeps_store() -> bool:
    """Whether this rank keeps a store ledger (ranks torchrun started), whose peers' calls can
    explain a collective's failure."""
    return _LEDGER is not None and _LEDGER.group is not None


def named(error: Exception) -> Exception:
    """A collective's failure as the parting behind it (a RuntimeError), where a store ledger's
    calls show one within FAILED_WAIT_S; else `error` itself. For collectives outside any call:
    a backward's gradient sync and the collectives of the executor's backward."""
    ledger = _LEDGER
    if ledger is None or ledger.group is None or ledger.stopped.is_set():
        return error
    why = _parting_behind(ledger, error)
    return error if why is None else RuntimeError(why)


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
    """A call that is one moment, not a block (a backward begins), counted at once where the
    rank's own thread has no call open, on whichever thread it happens: a GPU's backward runs on
    the device's autograd thread while the rank's waits for it. (Not yet run on a GPU.)"""
    ledger = _LEDGER
    if ledger is not None and ledger.current is None:
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
                if n in own and not _alike(own[n], name):
                    return (f"ranks {a} and {b} parted: rank {a}'s {_ordinal(n)} call to all ranks is {own[n]}, rank "
                            f"{b}'s {name}: every rank makes hap's collective calls alike and in the same order (each "
                            "holds its own part of the model: a call made on some ranks alone, DDP's `if rank == 0:` "
                            "habit, meets no partner)")
    return None


def _peer_ahead(every: dict[int, list[tuple[int, str]]], rank: int,
                among: Sequence[int] | None = None) -> tuple[int, int, int, str] | None:
    """(calls `rank` made, a peer (of `among`, default all) that made more, the number and name
    of the first call it made that `rank` has not), or None where no peer is ahead."""
    mine = every.get(rank, [])
    made = mine[-1][0] if mine else 0
    for r, calls in sorted(every.items()):
        ahead = [(n, name) for n, name in calls if n > made]
        if r != rank and ahead and (among is None or r in among):
            return made, r, *ahead[0]
    return None


def waits_outside(every: dict[int, list[tuple[int, str]]], me: int, collective: str,
                  among: Sequence[int] | None = None) -> str | None:
    """The one-line message where rank `me` waits in torch.distributed's `collective` over all
    ranks (or over the group of ranks `among`), outside hap's calls, while a peer of the group has
    made a call that `me` has not (the peer waits in it for `me`: the user's own collective made
    on some ranks alone, a lone `dist.barrier()`); None where no such peer is ahead."""
    found = _peer_ahead(every, me, among)
    over = "" if among is None else f" over ranks {list(among)}"
    return None if found is None else (
        f"ranks {found[1]} and {me} parted: rank {found[1]}'s {_ordinal(found[2])} call to all ranks is {found[3]}, "
        f"while rank {me} waits in torch.distributed's {collective}(...){over} outside hap's calls: a collective of "
        "your own made on some ranks alone meets no partner (every rank makes it, or none; hap's calls too)")


def aborted_behind(every: dict[int, list[tuple[int, str]]], rank: int) -> str | None:
    """Where gloo aborted `rank` (SIGABRT: its collective met another) outside hap's calls while a
    peer was in a call that `rank` had not made: what that says, in one line; else None."""
    found = _peer_ahead(every, rank)
    if found is None:
        return None
    made, r, n, name = found
    return (f"rank {rank} was aborted between hap's calls (it had made {made}), while rank {r}'s "
            f"{_ordinal(n)} call to all ranks is {name}: gloo aborts a rank whose collective meets another, "
            f"so rank {rank} likely made a collective of your own that not every rank made")


def left_behind(every: dict[int, list[tuple[int, str]]], rank: int) -> str | None:
    """Where `rank`'s collective lost its connection while a peer had made fewer calls (the peer
    left between hap's calls: its process group destroyed, or its process ended, on some ranks
    alone): what that says, in one line; else None."""
    mine = every.get(rank, [])
    if not mine:
        return None
    n, name = mine[-1]
    for r, calls in sorted(every.items()):
        made = calls[-1][0] if calls else 0
        if r != rank and made < n:
            return (f"rank {rank}'s {_ordinal(n)} call to all ranks, {name}, lost rank {r}, which had made {made} and left "
                    "between hap's calls (dist.destroy_process_group() or the end of its process, on some ranks "
                    "alone): every rank makes hap's collective calls alike and in the same order")
    return None


POINT_TO_POINT = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                            "recv_object_list"})
"""torch.distributed's messages to one peer: a rank waiting in one waits for that peer alone,
which may be behind while another is ahead (no parting)."""


def collective_waited_in(ident: int):
    """(the frame of the torch.distributed collective that the thread `ident` waits in: its
    outermost frame in distributed_c10d.py, `.f_code.co_name` naming it; the global ranks of its
    group, None for all), or None where it waits in none (or in a message to one peer)."""
    frame, found = sys._current_frames().get(ident), None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")) and code.co_name != "wrapper":
            found = frame  # (walking outwards: the last is the user's call)
        frame = frame.f_back
    if found is None or found.f_code.co_name in POINT_TO_POINT:
        return None
    group = found.f_locals.get("group")
    if group is None or group is dist.group.WORLD:
        return found, None
    try:
        return found, tuple(dist.get_process_group_ranks(group))
    except Exception:  # (a group destroyed meanwhile, or not one: nothing told)
        return None


class Suspicion:
    """A wait outside hap's calls behind a peer's call, ended only where SAME_READS reads in a row
    find the same one: a rank may be read in a collective every rank makes (its last bytes still
    on the way from a descheduled peer) just after a faster peer, done with it, began hap's next
    call; a collective made on this rank alone is still there reads later."""

    SAME_READS = 3

    def __init__(self):
        self.seen, self.reads = None, 0  # (the collective's frame, the message); reads that found it

    def confirms(self, frame, message: str | None) -> str | None:
        """The message where this read finds the wait the last SAME_READS - 1 reads found (the
        same call of the collective: its frame, held meanwhile, is no other call's), else None."""
        if frame is None or message is None:
            self.clear()
            return None
        same = self.seen is not None and self.seen[0] is frame and self.seen[1] == message
        self.seen, self.reads = (frame, message), self.reads + 1 if same else 1
        return message if self.reads >= self.SAME_READS else None

    def clear(self) -> None:
        self.seen, self.reads = None, 0


def read_all(path: str) -> dict[int, list[tuple[int, str]]]:
    """Every rank's latest calls, from the shared file at `path` (spawn's view after a failure)."""
    return Slots(path).read_every()


def whereabouts(every: dict[int, list[tuple[int, str]]]) -> str:
    """Where each rank was, for a timeout's report: each rank's last call to all ranks."""
    return "; ".join(f"rank {r}: its {_ordinal(calls[-1][0])}, {calls[-1][1]}" if calls else f"rank {r}: none yet"
                     for r, calls in sorted(every.items()))


def watch(end: Callable[[str, str], None]) -> None:
    """Start this rank's watching thread: once the rank has made no new call for STILL_S, it
    reads its peers' calls, and where two differ (or reads find this rank in the same collective
    of its own behind a peer's call) calls end(message, where the main thread is),
    which does not return."""
    ledger = _LEDGER
    assert ledger is not None and ledger.slots is not None

    def run():
        seen, since, still, suspicion, failing = ledger.calls, time.monotonic(), STILL_S, Suspicion(), Suspicion()
        while not ledger.stopped.wait(TICK_S):
            if ledger.calls != seen:
                seen, since, still = ledger.calls, time.monotonic(), STILL_S
                suspicion.clear()
                failing.clear()
                continue
            if time.monotonic() - since < still:
                continue
            if ledger.group is not None and dist.group.WORLD is not ledger.group:
                return  # (its process group was destroyed: a new one keeps a ledger of its own)
            try:
                every = ledger.slots.read_every()
            except Exception:  # (a store whose host has ended: no one left to compare with)
                return
            if ledger.stopped.is_set():
                return
            message = parted(every)
            if message is None and ledger.current is not None and ledger.pending is None:  # in a counted call:
                # a peer's raised there? (SAME_READS reads: this rank may be about to raise alike)
                suspicion.clear()
                message = failing.confirms(failing, failed_behind(every, ledger.rank, ledger.count))
            elif message is None and ledger.current is None:  # outside hap's calls: in a collective of the user's?
                failing.clear()
                found = collective_waited_in(ledger.thread)
                frame, among = found if found is not None else (None, None)
                outside = None if frame is None else waits_outside(every, ledger.rank, frame.f_code.co_name, among)
                message = suspicion.confirms(frame, outside)
                del found, frame  # (the suspicion holds it until the next read)
            else:
                suspicion.clear()
                failing.clear()
            if message is not None:
                end(message, _main_stack(ledger.thread))
            # read again STILL_S later; a store ledger's rank still longer reads ever less often
            # (up to STORE_STILL_MAX_S: every rank of a large world still reads the store's host)
            since = time.monotonic()
            if ledger.group is not None:
                still = min(2 * still, STORE_STILL_MAX_S)

    threading.Thread(target=run, daemon=True, name="hap-ledger").start()


def _main_stack(ident: int) -> str:
    frame = sys._current_frames().get(ident)
    return "".join(traceback.format_stack(frame)) if frame is not None else ""
