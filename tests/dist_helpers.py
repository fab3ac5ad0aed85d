"""Spawn W gloo processes on CPU, run a function in each, fail (never hang) on error."""

from __future__ import annotations

import gc
import os
import socket
import sys
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, err_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        gc.collect()  # release DDP reducers before the group goes away
        dist.barrier()  # nobody tears down while another rank still communicates
        dist.destroy_process_group()
    except BaseException:  # report to the parent, which fails the test
        code = 1
        with open(os.path.join(err_dir, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
    # Skip interpreter teardown: gloo's C++ threads can abort in static destructors
    # ("terminate called without an active exception") after everything succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned processes with a gloo group."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as err_dir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, err_dir)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = []
        for name in sorted(os.listdir(err_dir)):
            with open(os.path.join(err_dir, name)) as fh:
                errors.append(f"{name}:\n{fh.read()}")
        if hung:
            raise AssertionError(f"ranks {hung} did not finish in {timeout}s\n" + "\n".join(errors))
        if errors or any(p.exitcode != 0 for p in procs):
            raise AssertionError("\n".join(errors) or f"exit codes {[p.exitcode for p in procs]}")
