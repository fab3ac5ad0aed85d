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


def ranks_clip_on(rank, world, backend, fixed, deterministic, chunk, decoupled=True):
    """One rank of CLIP with ids, DCL (unless ``decoupled`` is False) and uneven sizes, gathered: ``backend`` (a
    kernel backend, run by Triton's interpreter on these CPU tensors) against the torch backend, values and
    gradients."""
    import torch

    import torch_contrastive as tc

    os.environ["TRITON_INTERPRET"] = "1"
    torch.use_deterministic_algorithms(deterministic)
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randn(20 + 5 * rank, 6, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.arange(x.shape[0]) % 4
    out = {}
    for name in ("torch", backend):
        leaves = [t.clone().requires_grad_() for t in (x, y)]
        value = tc.image_text_contrastive_loss(*leaves, 0.2, ids, normalize=fixed, gather=True, decoupled=decoupled, chunk_size=chunk,
                                               backend=name)
        out[name] = (value.detach(), *torch.autograd.grad(value, leaves))
    for a, b in zip(out[backend], out["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
