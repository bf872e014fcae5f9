"""Start ranks on this machine: one process per device of a local cluster, gloo, free ports.

    spawn(train_fn, world=2, args=(...,))   # train_fn(rank, *args) runs with the group initialized
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, world: int, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Run fn(rank, *args) on `world` local processes with a gloo group; a rank that fails or a
    collective that times out ends them all with that rank's error."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    port = free_port()
    mp.start_processes(_entry, args=(fn, world, port, args, timeout_s), nprocs=world, join=True, start_method="spawn")


def _entry(rank: int, fn: Callable, world: int, port: int, args: tuple, timeout_s: float) -> None:
    torch.set_num_threads(1)  # one core's worth per rank: ranks share this machine
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        fn(rank, *args)
        dist.barrier()  # no rank tears the group down while another still talks to it (gloo aborts)
    finally:
        dist.destroy_process_group()
