"""Start ranks on this machine: one process per device of a local cluster, gloo, meeting at a
store this process serves on a port the OS gives it (see rendezvous).

    spawn(train_fn, world=2, args=(...,))   # train_fn(rank, *args) runs with the group initialized

A rank that raises or dies, or a collective that waits longer than timeout_s, ends the run on
every rank (the others are killed, not left to wait out the gloo timeout) and spawn raises
RankFailed; its first line names the rank that caused it, its traceback (if any) follows:

    RankFailed: rank 1 failed: ValueError: boom
    RankFailed: rank 1 died with exit code 3
    RankFailed: rank 1 died from signal SIGKILL
    RankFailed: rank 0: collective timed out after 3 s waiting for rank 1 (stuck, slow, or in a different collective)
    RankFailed: ranks 0 and 1 parted: rank 0's 5th call to all ranks is checkpoint.save(dmodel, ...), rank 1's ...

The last: ranks whose calls to all ranks went different ways (ledger.py), found within a second.
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import sys
import tempfile
import threading
import time
import tokenize
import traceback
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import wait
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from . import ledger


class RankFailed(RuntimeError):
    """A rank raised, died, or timed out in a collective; `rank` is that rank."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


def rendezvous(timeout_s: float) -> dist.TCPStore:
    """Where local ranks meet: a store this process serves (keep it alive while they run) on a
    port the OS gave it as it bound it. A port found free and bound later by rank 0 could be
    taken in between by another run starting at the same time (EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


# How long ranks may take to arrive, however short the collective timeout: starting a process,
# importing torch and initializing CUDA took over 3 s on a GPU machine, and a run whose
# collectives time out after 3 s then failed before any collective ran.
STARTUP_S = 300.0


def join_group(backend: str, rank: int, world: int, port: int, timeout_s: float) -> None:
    """This rank's default process group, met at the rendezvous store on `port`: every rank first
    waits for all to arrive (up to STARTUP_S), then joins a group whose collectives time out
    after timeout_s (gloo's connecting counts as one)."""
    startup = max(timeout_s, STARTUP_S)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=startup))
    arrived = [f"hap/arrived/{r}" for r in range(world)]
    store.set(arrived[rank], "1")
    try:
        store.wait(arrived)
    except dist.DistStoreError:
        missing = [r for r in range(world) if not store.check([arrived[r]])]
        raise TimeoutError(f"rank(s) {', '.join(map(str, missing))} did not start within {startup:g} s") from None
    store.set_timeout(timedelta(seconds=timeout_s))  # all arrived: later waits (a new group's) are collectives
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def spawn(fn: Callable, world: int, args: tuple = (), timeout_s: float = 120.0, backend: str = "gloo") -> None:
    """Run fn(rank, *args) on `world` local processes with a process group (gloo; or nccl, each
    rank on GPU `rank`) whose collectives time out after timeout_s; a rank that fails ends them
    all and raises RankFailed naming it."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    check_importable(fn)
    if backend == "nccl" and world > torch.cuda.device_count():
        raise ValueError(f"nccl needs a GPU per rank: {world} ranks, {torch.cuda.device_count()} CUDA devices "
                         f"(gloo lets ranks share a GPU)")
    with tempfile.TemporaryDirectory(prefix="hap-ranks-") as reports:
        ledger.Slots.create(os.path.join(reports, LEDGER), world)
        store = rendezvous(timeout_s)  # (served until spawn returns)
        # start_ranks starts them (each dies with this process); the joining is ours: torch's
        # ProcessContext.join blames whichever failure it sees first (often a peer's "Connection
        # closed by peer") and gives stuck ranks 30 s after SIGTERM.
        procs = start_ranks(_entry, (fn, world, store.port, args, timeout_s, reports, backend), world)
        try:
            gone = _wait(procs)
        finally:  # however we leave (a failure, Ctrl-C), no rank outlives spawn
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        if gone:
            raise _failure(procs, gone, reports)


def start_ranks(fn: Callable, args: tuple, world: int) -> list:
    """Start `world` processes running fn(rank, *args) (not joined), forked from a server process
    that imported hap once (multiprocessing's forkserver, which torch supports): a rank started
    bare spent 1.5-2.5 s of CPU importing torch and hap before its first line, 4 ranks on 2
    cores 5 s a run. The server touches no GPU. Each rank is interrupted (SIGINT, then ended
    5 s later) when this process ends, however it ends."""
    global _START
    check_main_guard()
    mp.set_forkserver_preload(["hap"])  # (for the server's start: the first call's)
    launched = (os.getpid(), _Launcher(), fn, args)
    try:
        if _START == "forkserver":
            _start_server_deaf_to_ctrl_c()
        return mp.start_processes(_as_launched, args=launched, nprocs=world, join=False, start_method=_START).processes
    except ChildProcessError:  # (raised before any rank started)
        # A process forked from one that ran a forkserver holds that server's record and
        # cannot use it (multiprocessing waits for it as its own child): ranks start bare here.
        _START = "spawn"
        return mp.start_processes(_as_launched, args=launched, nprocs=world, join=False, start_method=_START).processes


_START = "forkserver"


def _start_server_deaf_to_ctrl_c() -> None:
    """Start multiprocessing's forkserver, where it is not running, with SIGINT ignored, which it
    keeps across its exec. It ignores SIGINT once it has imported hap, but that import takes
    seconds: a Ctrl-C then (to the terminal's whole process group) printed its 50-line
    KeyboardInterrupt traceback, or a RecursionError of a half-imported numpy, after
    `hap: interrupted`. Its ranks take the launcher's handler back (_Launcher.take)."""
    if threading.current_thread() is not threading.main_thread():  # (signal.signal needs the main thread)
        return
    from multiprocessing import forkserver
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, before)


def check_main_guard() -> None:
    """A RuntimeError, in one line, where ranks are started from the top level of the script
    being run outside `if __name__ == "__main__":`. Each rank imports that script as it starts
    (multiprocessing's forkserver and spawn do), so each ran the call again and died: 95-150
    lines of interleaved tracebacks, and then "rank 0 died with exit code 1"."""
    import ast
    import inspect

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or not path.endswith(".py"):
        return  # an interpreter, python -c, a notebook: nothing to import again
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.endswith("__main__"):
        return  # python -m package (its __main__.py): multiprocessing does not import it again
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"):
        frame = frame.f_back
    if frame is None:
        return  # not called from the script's top level (a test runner's, a module's)
    line = frame.f_lineno
    tree = _script_tree(path)
    if tree is None:
        return
    if not any(_is_main_guard(node) and node.lineno <= line <= (node.end_lineno or node.lineno)
               for node in ast.walk(tree)):
        raise RuntimeError(f"{os.path.basename(path)}:{line} starts hap's ranks at the script's top level: each rank "
                           "imports the script as it starts and would run that line again; put the script's top-level "
                           'code under `if __name__ == "__main__":`')


def check_importable(fn: Callable) -> None:
    """A RuntimeError, in one line, where the ranks could not find `fn`: a lambda or a function
    defined inside another (pickled by name, "Can't pickle local object", a 31-line traceback);
    defined in a __main__ they do not import as they start (python -m package's __main__.py,
    python -c, a notebook), or under the script's `if __name__ == "__main__":`, which a rank
    importing the script skips (each rank died unpickling it, "Can't get attribute", then
    "rank 0 died with exit code 1")."""
    name = str(getattr(fn, "__qualname__", fn))  # (a functools.partial has none: its function is pickled by value)
    if hasattr(fn, "__qualname__") and ("<lambda>" in name or "<locals>" in name):
        what = "a lambda" if name.endswith("<lambda>") else f"{name}, defined inside a function,"
        raise RuntimeError(f"{what} cannot be sent to the ranks (each finds its function by module and name): define "
                           "it at the top level of a module")
    if getattr(fn, "__module__", None) != "__main__":
        return
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.endswith("__main__"):
        where = f"{spec.name} (python -m {spec.parent})"
    elif getattr(main, "__file__", None) is None:
        where = "a __main__ with no file (python -c, an interactive session, a notebook)"
    else:  # a script: each rank imports it again as __mp_main__, skipping its main guard
        if _only_under_main_guard(main.__file__, name):
            raise RuntimeError(f'{name} is defined under `if __name__ == "__main__":` in '
                               f"{os.path.basename(main.__file__)}, which each rank skips as it imports the script: "
                               "define it above that block")
        return
    raise RuntimeError(f"{name} is defined in {where}, which the ranks do not import as "
                       "they start: define it in a module they can import")


def _script_tree(path: str):
    """The script at `path` parsed (in its own encoding), or None where it cannot be read."""
    import ast
    try:
        with tokenize.open(path) as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def _only_under_main_guard(path: str, name: str) -> bool:
    """Whether the script at `path` binds `name` (a def, class, assignment or import) only
    inside `if __name__ == "__main__":` blocks (False where it cannot be read)."""
    import ast
    tree = _script_tree(path)
    if tree is None:
        return False
    guarded, outside = False, False

    def visit(statements, under_guard: bool) -> None:
        nonlocal guarded, outside
        for node in statements:
            bound = set()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update((a.asname or a.name).split(".")[0] for a in node.names)
                if any(a.name == "*" for a in node.names):
                    outside = True  # (a star import may bind it: not refused)
            if name in bound:
                guarded, outside = guarded or under_guard, outside or not under_guard
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # (its body binds names of its own)
            for field in ("body", "orelse", "finalbody", "handlers"):  # blocks at the top level: if, try, with, for
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit(inner, under_guard or (_is_main_guard(node) and field == "body"))

    visit(tree.body, False)
    return guarded and not outside


def _is_main_guard(node) -> bool:
    """Whether an ast node is an `if` whose test compares __name__ with "__main__" (either way
    round, alone or within `and`: false as a rank imports the script, as __mp_main__)."""
    import ast

    def compares(c) -> bool:
        if not (isinstance(c, ast.Compare) and len(c.comparators) == 1 and isinstance(c.ops[0], ast.Eq)):
            return False
        sides = [c.left, c.comparators[0]]
        return any(isinstance(a, ast.Name) and a.id == "__name__" for a in sides) and \
            any(isinstance(a, ast.Constant) and a.value == "__main__" for a in sides)

    return isinstance(node, ast.If) and any(compares(c) for c in ast.walk(node.test))


class _Launcher:
    """What a rank takes from its launcher as it starts, as a spawned rank did: its stdout and
    stderr (the same open files: a log it was redirected to, pytest's capture) and environment.
    A forked rank has the forkserver's, which are the launcher's at the server's start."""

    def __init__(self, stdio: tuple = (), env: dict | None = None, ctrl_c: bool = True):
        self.stdio, self.env, self.ctrl_c = stdio, env, ctrl_c

    def __reduce__(self):  # (pickled as the rank starts: the descriptors go with it)
        return _Launcher, (tuple((fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd)), dict(os.environ),
                           signal.getsignal(signal.SIGINT) != signal.SIG_IGN)

    def take(self) -> None:
        for fd, passed in self.stdio:
            got = passed.detach()
            os.dup2(got, fd)
            os.close(got)
        os.environ.clear()
        os.environ.update(self.env)
        # a Ctrl-C interrupts the rank where it interrupts the launcher (the forkserver's ignoring
        # of SIGINT is what a forked rank inherits)
        signal.signal(signal.SIGINT, signal.default_int_handler if self.ctrl_c else signal.SIG_IGN)


def _as_launched(rank: int, launcher: int, state: _Launcher, fn: Callable, args: tuple) -> None:
    """fn(rank, *args) with the launcher's stdout, stderr and environment, interrupted when the
    launcher ends. torch's own death signal fires when the rank's parent ends, and that is the
    forkserver, which outlives the launcher as long as any rank it forked lives: a killed
    `hap train` left its ranks running for ever."""
    state.take()

    def interrupt_when_gone():
        try:
            select.select([os.pidfd_open(launcher)], [], [])  # readable once the launcher has ended
        except ProcessLookupError:  # ended (and reaped) before we started
            pass
        except (AttributeError, OSError):  # no pidfd (not Linux 5.3+): look every second
            while _exists(launcher):
                time.sleep(1.0)
        if callable(signal.getsignal(signal.SIGINT)):  # Python's handler: the rank unwinds
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5.0)
        os._exit(1)  # SIGINT ignored (inherited, as by `cmd &` in a script), or stuck in a C call
    threading.Thread(target=interrupt_when_gone, daemon=True, name="hap-launcher-watch").start()
    fn(rank, *args)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _wait(procs: list) -> set[int]:
    """Wait until every rank has exited 0 (returns {}) or one has failed: then the ranks that had
    exited by themselves (before the caller kills the rest)."""
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        for s in wait(list(running)):
            procs[running.pop(s)].join()
        if any(p.exitcode for p in procs):
            for s in wait(list(running), timeout=0):  # gone too, perhaps not yet reaped
                procs[running.pop(s)].join()
            return set(range(len(procs))) - set(running.values())
    return set()


def _failure(procs: list, gone: set[int], reports: str) -> RankFailed:
    """The error of the rank that caused the failure. A rank that raises reports (when, what)
    before its peers can notice, so of the errors raised by the ranks' own code the earliest is
    the cause; else a rank that died without a report (os._exit, a signal): the errors its peers'
    collectives raised ("Connection closed by peer") follow from it; else the earliest of those
    (a collective that timed out)."""
    told = {}
    for rank in range(len(procs)):
        path = os.path.join(reports, f"{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                told[rank] = json.load(f)
    own = sorted((r for r in told if told[r]["own"]), key=lambda r: told[r]["time"])
    died = sorted(r for r in gone if r not in told and procs[r].exitcode != 0)
    if own or not died:
        rank = (own or sorted(told, key=lambda r: told[r]["time"]))[0]
        return RankFailed(f"{told[rank]['headline']}\n\n{told[rank]['traceback']}", rank)
    rank, code = died[0], procs[died[0]].exitcode
    try:
        how = f"exit code {code}" if code > 0 else f"signal {signal.Signals(-code).name}"
    except ValueError:
        how = f"signal {-code}"
    headline = f"rank {rank} died {'with' if code > 0 else 'from'} {how}"
    every = ledger.read_all(os.path.join(reports, LEDGER))
    why = ledger.parted(every)  # (gloo aborts a rank at a mismatch)
    if why is None and code == -signal.SIGABRT:
        why = ledger.aborted_behind(every, rank)
    return RankFailed(f"{why} ({headline})" if why else headline, rank)


_TIMEOUT: timedelta | None = None

LEDGER = "ledger"
"""The file, among the ranks' reports, of every rank's latest calls (ledger.Slots)."""


def collective_timeout() -> timedelta | None:
    """How long this rank's collectives may wait (spawn's timeout_s), for the process groups
    made after start-up; None outside spawn (torch's default)."""
    return _TIMEOUT


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple, timeout_s: float, reports: str,
           backend: str = "gloo") -> None:
    global _TIMEOUT
    torch.set_num_threads(1)  # one core's worth per rank: ranks share this machine
    # A rank's own lock for tqdm (torch.fx makes disabled progress bars while capturing): its
    # default is a process-shared semaphore, which os._exit below would leave behind, and the
    # resource tracker then warns of a leak at the end of every run.
    tqdm.set_lock(threading.RLock())
    _TIMEOUT = timedelta(seconds=timeout_s)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        ledger.keep(rank, os.path.join(reports, LEDGER))
        join_group(backend, rank, world, port, timeout_s)
        if world > 1:
            ledger.watch(functools.partial(_end_parted, rank, reports))
        fn(rank, *args)
        ledger.returned()  # (a peer still in a call learns it: they parted)
        dist.barrier()  # no rank tears the group down while another still talks to it (gloo aborts)
        dist.destroy_process_group()
    except BaseException as e:
        try:
            _report(rank, world, e, timeout_s, reports)
        finally:  # no teardown: the peers learn from the closed sockets, the parent kills them
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    # Done: leave without the interpreter's finalization, whose C++ destructors have been seen
    # to abort a rank (SIGABRT, "terminate called without an active exception") after a clean
    # teardown, which would report a finished run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end_parted(rank: int, reports: str, message: str, stack: str) -> None:
    """End this rank, its ledger having found that it and a peer parted (the parent ends the rest)."""
    _write_report(rank, reports, message, stack, own=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _report(rank: int, world: int, e: BaseException, timeout_s: float, reports: str) -> None:
    """Write what this rank hit, and when, for the parent (atomically: it may kill us any time)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    in_dist = tb is not None and tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(dist.__file__))
    # (a collective hap waits on itself, work.wait() on an async handle, times out in gloo's words)
    in_collective = in_dist or "gloo/transport" in str(e)
    peers = [str(r) for r in range(world) if r != rank]
    if not (in_collective and "timed out" in str(e).lower()):
        headline = f"rank {rank} failed: " + "".join(traceback.format_exception_only(e)).strip().splitlines()[0]
        if in_collective and dist.is_initialized():  # a peer that left: gloo's "Connection reset by peer" alone
            every = ledger.read_all(os.path.join(reports, LEDGER))
            why = ledger.parted(every) or ledger.left_behind(every, rank)
            if why is not None:
                headline = f"rank {rank} failed: {why}"
    elif not dist.is_initialized():
        headline = f"rank {rank}: timed out after {timeout_s:g} s setting up the process group (a peer is slow to start)"
    elif len(peers) == 1:
        headline = f"rank {rank}: collective timed out after {timeout_s:g} s waiting for rank {peers[0]} " \
                   "(stuck, slow, or in a different collective)"
    else:
        headline = f"rank {rank}: collective timed out after {timeout_s:g} s waiting for a peer: one of ranks " \
                   f"{', '.join(peers)} is stuck, slow, or in a different collective (gloo does not say which)"
    if in_collective and "timed out" in str(e).lower() and dist.is_initialized():
        every = ledger.read_all(os.path.join(reports, LEDGER))
        if any(every.values()):  # (none: the ranks were not in hap's calls)
            headline += f"; the ranks' last calls to all: {ledger.whereabouts(every)}"
    _write_report(rank, reports, headline, traceback.format_exc(), own=not in_collective)


def _write_report(rank: int, reports: str, headline: str, trace: str, own: bool) -> None:
    report = {"time": time.monotonic(), "own": own, "headline": headline, "traceback": trace}
    path = os.path.join(reports, f"{rank}.json")
    # a temporary file of this writer's own: a rank's watcher thread and its main thread may
    # both report (a parting seen, then the collective it broke), and a shared one, truncated
    # by the second while the first moved it in place, was read empty (CI at 5c58163)
    mine = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(mine, "w") as f:
        json.dump(report, f)
    os.replace(mine, path)
