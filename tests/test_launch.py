"""hap's launcher ends a failed run on every rank, fast, with one clear line naming the rank:
a rank that raises, one that dies without a word (exit code, signal), and a collective that
times out. The healthy ranks wait in a collective meanwhile, and no process is left behind."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from gloo import still_running

from hap.runtime.launch import RankFailed, spawn


def all_reduce_unless(rank, fault_rank, fault, pid_dir, async_op=False):
    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    if rank == fault_rank:
        fault()
    t = torch.ones(2)
    if async_op:  # waited on here, as hap's bucketed gradient sync waits: gloo's own words time out
        dist.all_reduce(t, async_op=True).wait()
    else:
        dist.all_reduce(t)
    assert t.tolist() == [dist.get_world_size()] * 2


def boom():
    raise ValueError("boom")


def exit_3():
    os._exit(3)


def sigkill_self():
    os.kill(os.getpid(), signal.SIGKILL)


def sleep_long():
    time.sleep(30)


def run(tmp_path, world, fault_rank, fault, timeout_s, async_op=False):
    """spawn's error (None if it returned), seconds taken; asserts no rank process is left."""
    start = time.monotonic()
    try:
        spawn(all_reduce_unless, world, args=(fault_rank, fault, str(tmp_path), async_op), timeout_s=timeout_s)
        error = None
    except RankFailed as e:
        error = e
    took = time.monotonic() - start
    for rank in range(world):
        pid = int((tmp_path / str(rank)).read_text())
        with pytest.raises(ProcessLookupError):  # gone and reaped
            os.kill(pid, 0)
    return error, took


def test_healthy_run_returns(tmp_path):
    error, _ = run(tmp_path, 2, None, None, 60)
    assert error is None


def test_a_rank_that_raises_ends_the_run(tmp_path):
    error, took = run(tmp_path, 3, 1, boom, 60)
    assert str(error).splitlines()[0] == "rank 1 failed: ValueError: boom"
    assert error.rank == 1 and isinstance(error, RuntimeError)
    assert "Traceback" in str(error) and 'raise ValueError("boom")' in str(error)
    assert took < 20  # not the 60 s collective timeout


@pytest.mark.parametrize("fault, how", [(exit_3, "with exit code 3"), (sigkill_self, "from signal SIGKILL")])
def test_a_rank_that_dies_ends_the_run(tmp_path, fault, how):
    error, took = run(tmp_path, 2, 1, fault, 60)
    assert str(error) == f"rank 1 died {how}"
    assert took < 20


@pytest.mark.parametrize("async_op", [False, True])
def test_a_collective_that_times_out_ends_the_run(tmp_path, async_op):
    error, took = run(tmp_path, 2, 1, sleep_long, 3, async_op)
    assert str(error).splitlines()[0] == \
        "rank 0: collective timed out after 3 s waiting for rank 1 (stuck, slow, or in a different collective)"
    assert "all_reduce" in str(error)  # rank 0's traceback: where it waited
    assert 3 < took < 20  # the sleeping rank is killed, not waited for


def join_late(rank, port, out):
    time.sleep(4.0 * rank)  # as slow to start as a rank importing torch and CUDA on a GPU machine
    from hap.runtime.launch import join_group
    join_group("gloo", rank, 2, port, timeout_s=1.0)
    t = torch.ones(1)
    dist.all_reduce(t)
    (out / str(rank)).write_text(str(t.item()))
    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_slow_to_start_is_waited_for_beyond_the_collective_timeout(tmp_path):
    # on a GPU machine a 3 s collective timeout once failed a run before any collective ran
    from hap.runtime.launch import rendezvous
    store = rendezvous(1.0)
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=join_late, args=(rank, store.port, tmp_path)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [(tmp_path / str(rank)).read_text() for rank in range(2)] == ["2.0", "2.0"]


def test_a_rank_that_never_starts_is_named(monkeypatch):
    from hap.runtime import launch
    store = launch.rendezvous(1.0)
    monkeypatch.setattr(launch, "STARTUP_S", 1.0)
    with pytest.raises(TimeoutError, match=r"^rank\(s\) 1, 2 did not start within 1 s$"):
        launch.join_group("gloo", 0, 3, store.port, timeout_s=0.5)
    assert not dist.is_initialized()


def test_nccl_with_more_ranks_than_gpus_is_refused_before_starting():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"nccl needs a GPU per rank: {n + 1} ranks, {n} CUDA devices"):
        spawn(boom, n + 1, backend="nccl")


def make_a_progress_bar(rank):
    from tqdm import tqdm
    tqdm(total=1, disable=True)  # as torch.fx does while hap captures a model


def test_a_finished_run_leaves_no_semaphore_behind(tmp_path):
    # ranks end with os._exit: tqdm's default process-shared lock outlived every rank, and
    # the resource tracker warned of "leaked semaphore objects" after every healthy run
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text("from hap.runtime.launch import spawn\nfrom test_launch import make_a_progress_bar\n"
                      "if __name__ == '__main__':\n    spawn(make_a_progress_bar, 2)\n    print('returned')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0 and done.stdout.strip() == "returned", done.stderr
    assert "leaked semaphore" not in done.stderr


def say_hello_and_what_is_set(rank, out_dir):
    os.write(1, f"rank {rank} says hello\n".encode())  # (one write: the ranks' lines do not interleave)
    with open(os.path.join(out_dir, str(rank)), "w") as f:
        f.write(os.environ.get("HAP_TEST_SETTING", "unset"))


def test_ranks_write_to_the_launchers_stdout_and_read_its_environment_as_they_start(tmp_path, monkeypatch):
    """Ranks are forked by a server that started with the launcher's stdout and environment of
    that moment: a run's output went to wherever stdout had been when the first run started
    (another test's capture), and a setting made since was not seen."""
    spawn(make_a_progress_bar, 2)  # the server started here at the latest, with stdout as it is now
    monkeypatch.setenv("HAP_TEST_SETTING", "set since")
    read, write = os.pipe()
    stdout = os.dup(1)
    os.dup2(write, 1)  # stdout redirected since
    try:
        spawn(say_hello_and_what_is_set, 2, args=(str(tmp_path),))
    finally:
        os.dup2(stdout, 1)
        os.close(stdout)
        os.close(write)
    with os.fdopen(read) as f:
        said = [line for line in f.read().splitlines() if line.startswith("rank ")]
    assert sorted(said) == ["rank 0 says hello", "rank 1 says hello"]
    assert [(tmp_path / str(r)).read_text() for r in range(2)] == ["set since"] * 2


def run_ranks_in_a_fork():
    spawn(make_a_progress_bar, 2)


def test_a_process_forked_from_a_launcher_launches_too():
    """multiprocessing keeps one forkserver per process: a process forked from a launcher that
    ran one held its record and failed to start ranks (ChildProcessError), where spawned ranks
    had started (a sweep in multiprocessing workers after a run of its own)."""
    spawn(make_a_progress_bar, 2)  # this process's forkserver runs
    child = torch.multiprocessing.get_context("fork").Process(target=run_ranks_in_a_fork)
    child.start()
    child.join(120)
    assert child.exitcode == 0


def sleep_for_ever(rank, pid_dir):
    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


@pytest.mark.parametrize("interrupt", ["handled", "ignored"])
def test_the_ranks_end_with_the_process_that_started_them(tmp_path, interrupt):
    """Ranks are forked by multiprocessing's forkserver, which lives as long as any rank it forked
    does: torch's signal on the parent's death never came, and a killed `hap train` left its
    ranks (and the server) running for ever. A launcher started with SIGINT ignored (by
    `cmd &` in a script) passes that on to its ranks: an interrupt would not end them."""
    import subprocess
    import sys
    script = tmp_path / "run.py"
    script.write_text("import sys\nfrom hap.runtime.launch import spawn\nfrom test_launch import sleep_for_ever\n"
                      "if __name__ == '__main__':\n    spawn(sleep_for_ever, 2, args=(sys.argv[1],))\n")
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if interrupt == "ignored" else None
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], preexec_fn=ignore, env={
        **os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])})
    deadline = time.monotonic() + 120
    while not all((tmp_path / str(r)).exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # (a pid file is written before it is complete)
    ranks = [int((tmp_path / str(r)).read_text()) for r in range(2)]
    launcher.kill()
    launcher.wait()
    assert still_running(ranks) == []


def write_how_ctrl_c_is_met(rank, out_dir):
    handler = signal.getsignal(signal.SIGINT)
    said = "interrupted" if handler is signal.default_int_handler else "ignored" if handler == signal.SIG_IGN else repr(handler)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(said)


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


@pytest.mark.parametrize("interrupt", ["handled", "ignored"])
def test_the_forkserver_ignores_ctrl_c_from_its_start_and_the_ranks_meet_it_as_the_launcher(tmp_path, interrupt):
    """A Ctrl-C in the first seconds of `hap train` reaches the forkserver while it imports hap:
    it printed a 50-line KeyboardInterrupt traceback (it ignores SIGINT only once its imports are
    done). It now starts ignoring SIGINT; each rank meets SIGINT as its launcher does."""
    import subprocess
    import sys
    script = tmp_path / "run.py"
    # the server is started as start_ranks starts it, and interrupted at once, in its imports
    script.write_text("import os, signal, sys\nfrom multiprocessing import forkserver\nimport torch.multiprocessing as mp\n"
                      "from hap.runtime import launch\nfrom test_launch import write_how_ctrl_c_is_met, _ignores_sigint\n"
                      "if __name__ == '__main__':\n    mp.set_forkserver_preload(['hap'])\n"
                      "    launch._start_server_deaf_to_ctrl_c()\n    server = forkserver._forkserver._forkserver_pid\n"
                      "    print(_ignores_sigint(server))\n    os.kill(server, signal.SIGINT)\n"
                      "    launch.spawn(write_how_ctrl_c_is_met, 2, args=(sys.argv[1],))\n"
                      "    print(forkserver._forkserver._forkserver_pid == server)\n")
    # (the launcher's own SIGINT set either way: a test run in the background ignores it, which
    # the launcher would inherit)
    how = signal.SIG_IGN if interrupt == "ignored" else signal.SIG_DFL
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], preexec_fn=lambda: signal.signal(signal.SIGINT, how),
                          capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"] and "KeyboardInterrupt" not in done.stderr, done.stderr
    expected = "interrupted" if interrupt == "handled" else "ignored"
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == [expected] * 2


def test_the_rendezvous_port_is_held_from_the_moment_it_is_chosen():
    """Two runs starting together once took the same port: a port was found free, released, and
    bound by rank 0 later (EADDRINUSE). The parent now serves the store on the port the OS gave
    it while binding: nobody else can bind it, and two stores get two ports."""
    import errno
    import socket

    from hap.runtime.launch import rendezvous

    first, second = rendezvous(5.0), rendezvous(5.0)
    assert first.port != second.port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(OSError) as taken:
            s.bind(("127.0.0.1", first.port))
    assert taken.value.errno == errno.EADDRINUSE


SCRIPT = """\
from hap.runtime.launch import spawn


def say(rank):
    import os; os.write(1, f"rank {{rank}}\\n".encode())  # one write: the two ranks' lines do not interleave


{call}
"""


@pytest.mark.parametrize("call,refused", [
    ("spawn(say, 2)", True),
    ("def main():\n    spawn(say, 2)\n\n\nmain()", True),  # a call reached from the top level, unguarded
    ('if __name__ == "__main__":\n    spawn(say, 2)', False),
    ('def main():\n    spawn(say, 2)\n\n\nif "__main__" == __name__:\n    main()', False),
    ('import os\nif __name__ == "__main__" and not os.environ.get("DRY_RUN"):\n    spawn(say, 2)', False)])
def test_ranks_started_from_a_scripts_unguarded_top_level_are_refused_in_one_line(call, refused, tmp_path):
    """Each rank imports the script as it starts and ran the call again: 95-150 lines of
    interleaved tracebacks, then "rank 0 died with exit code 1"."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(call=call))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if refused:
        line = call.splitlines().index(next(c for c in call.splitlines() if c.startswith(("spawn", "main()"))))
        assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
            f"RuntimeError: train.py:{8 + line} starts hap's ranks at the script's top level: each rank imports the "
            "script as it starts and would run that line again; put the script's top-level code under "
            '`if __name__ == "__main__":`'), run.stderr
        assert "rank" not in run.stdout
    else:
        assert run.returncode == 0 and {"rank 0", "rank 1"} <= set(run.stdout.splitlines()), (run.stdout, run.stderr)


def test_a_function_the_ranks_cannot_import_is_refused_in_one_line(tmp_path):
    """Defined in python -m package's __main__.py or under python -c: each rank died unpickling
    it ("Can't get attribute 'say' on <module '__main__'>"), then "rank 0 died with exit code 1"."""
    import subprocess
    import sys

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(SCRIPT.format(call="spawn(say, 2)"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv, where in ((["-m", "pkg"], "pkg.__main__ (python -m pkg)"),
                        (["-c", SCRIPT.format(call="spawn(say, 2)")],
                         "a __main__ with no file (python -c, an interactive session, a notebook)")):
        run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
        assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
            f"RuntimeError: say is defined in {where}, which the ranks do not import as they start: define it in a "
            "module they can import"), run.stderr


@pytest.mark.parametrize("body, said", [
    ('if __name__ == "__main__":\n    def work(rank):\n        pass\n    spawn(work, 2)',
     'work is defined under `if __name__ == "__main__":` in train.py, which each rank skips as it imports the script: '
     'define it above that block'),
    ('def main():\n    def work(rank):\n        pass\n    spawn(work, 2)\n\n\nif __name__ == "__main__":\n    main()',
     "main.<locals>.work, defined inside a function, cannot be sent to the ranks (each finds its function by module "
     "and name): define it at the top level of a module"),
    ('if __name__ == "__main__":\n    spawn(lambda rank: None, 2)',
     "a lambda cannot be sent to the ranks (each finds its function by module and name): define it at the top level "
     "of a module"),
    # defined above the guard and again under it: the ranks find the first (not refused)
    ('def work(rank):\n    say(rank)\n\n\nif __name__ == "__main__":\n    def work(rank):\n        say(rank)\n'
     '    spawn(work, 2)', None)])
def test_a_rank_function_a_rank_importing_the_script_cannot_find_is_refused_in_one_line(body, said, tmp_path):
    """Defined under the script's main guard (each rank died unpickling it: "Can't get
    attribute 'work' on <module '__mp_main__'>", 17 lines, then "rank 0 died with exit code 1"),
    inside a function or as a lambda (31 lines of "Can't pickle local object")."""
    import subprocess
    import sys

    (tmp_path / "train.py").write_text(SCRIPT.format(call=body))
    run = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if said is None:
        assert run.returncode == 0 and {"rank 0", "rank 1"} <= set(run.stdout.splitlines()), run.stderr
    else:
        assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == f"RuntimeError: {said}", run.stderr
