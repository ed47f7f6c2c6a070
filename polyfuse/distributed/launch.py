"""Entry points under torchrun: one process per device, rank 0 speaks, every rank exits promptly on an error.

``distributed_entry(main)`` wraps a CLI ``main(argv) -> exit code``. Without ``WORLD_SIZE`` > 1 it calls ``main``
unchanged. Under torchrun it asks for tensor-parallel builds (the process group is created by the first model
build, whose device picks NCCL / HCCL / gloo), sends the stdout and stderr of ranks other than 0 to /dev/null
(every rank runs the same command, so rank 0's output and error line stand for all of them), and ends the process
with ``os._exit``: after a failure at once, so a rank never lingers in interpreter shutdown or in
``destroy_process_group`` waiting for a peer that will not come; after success once every rank is done and the
process group is destroyed (skipping the interpreter teardown, where gloo can abort when a peer exits at the same
moment). An exception ``main`` does not handle prints one line on every rank it happens on (``error: rank N: ...``
on ranks other than 0: rank 0 may not know about it); the launcher then stops the remaining ranks (torchrun
watches its workers and terminates the others when one exits non-zero).

``spawn_main(argv)``: optimum-habana's ``gaudi_spawn.py --world_size N script.py ARGS`` form, run with
torchrun's own machinery (``torch.distributed.run``: rendezvous, worker supervision, signal forwarding) rather than
a process manager of our own; it exits with the first failing rank's exit code and adds no traceback of its own.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys

from polyfuse.core import settings
from polyfuse.core.errors import one_line
from polyfuse.distributed.context import request_from_env, shutdown, world_size_from_env


def distributed_entry(main=None, *, tensor_parallel: bool = True):
    """``tensor_parallel=False`` (training: run_clm.py, whose data-parallel / FSDP2 process group is the Trainer's):
    the same rank-0 output and prompt exits, without asking for tensor-parallel model builds."""
    if main is None:
        return functools.partial(distributed_entry, tensor_parallel=tensor_parallel)

    @functools.wraps(main)
    def wrapper(argv=None):
        if world_size_from_env() <= 1:
            return main(argv)
        return _ranked(main, argv, tensor_parallel)

    return wrapper


def _ranked(main, argv, tensor_parallel: bool = True) -> int:
    rank = settings.get("RANK", 0)
    stderr = sys.stderr
    if rank != 0:
        # Quiet at the file descriptors too: logging handlers made at import (transformers' warnings) and torch's C++
        # warnings write there, not to sys.stderr. ``stderr`` keeps the original for this rank's own error line.
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        stderr = os.fdopen(os.dup(2), "w")
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)
        quiet = open(os.devnull, "w")
        sys.stdout = sys.stderr = quiet
    if tensor_parallel:
        request_from_env()
    try:
        code = main(argv)
        code = 0 if code is None else int(code)
    except SystemExit as e:  # argparse: usage errors (printed by rank 0 only) and --help
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except KeyboardInterrupt:
        code = 130
    except BaseException as e:
        where = "" if rank == 0 else f"rank {rank}: "
        print(f"error: {where}{type(e).__name__}: {one_line(e)}", file=stderr, flush=True)
        code = 1
    if code == 0:
        shutdown()
    for stream in (sys.stdout, sys.stderr, stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def spawn_parser() -> argparse.ArgumentParser:
    """optimum-habana's gaudi_spawn.py arguments, same spelling and defaults (``--main_process_port``: accelerate's
    name for the port, accepted too)."""
    p = argparse.ArgumentParser(
        description="Run a script on N local devices with torchrun's machinery (optimum-habana's gaudi_spawn.py form)"
    )
    p.add_argument("--world_size", type=int, default=1, help="processes (devices) on this machine")
    p.add_argument("--hostfile", type=str, default=None, help="multi-node host file (refused: one machine only)")
    p.add_argument("--use_mpi", action="store_true", help="accepted; the ranks are started by torchrun, not mpirun")
    p.add_argument(
        "--use_deepspeed",
        action="store_true",
        help="start the ranks with DeepSpeed's launcher where DeepSpeed is installed (else torchrun, with a warning); "
        "the model is still sharded by polyfuse's tensor parallelism",
    )
    p.add_argument("--master_port", "--main_process_port", type=int, default=None,
                   help="rendezvous port (default: a free one; gaudi_spawn's default is 29500)")  # fmt: skip
    p.add_argument("script", help="the script every rank runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _deepspeed_command(args) -> list:
    """DeepSpeed's launcher on this machine, which sets RANK / LOCAL_RANK / WORLD_SIZE for each rank as torchrun."""
    port = ["--master_port", str(args.master_port)] if args.master_port else []
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(args.world_size), *port,
            args.script, *args.script_args]  # fmt: skip


def spawn_main(argv=None) -> int:
    """``python examples/spawn.py --world_size N [--use_deepspeed] [--master_port P] script.py [script args]``."""
    import importlib.util
    import subprocess

    args = spawn_parser().parse_args(argv)
    if args.world_size < 1:
        print(f"error: --world_size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    if args.hostfile:
        print(f"error: --hostfile {args.hostfile}: multi-node runs are not supported (one machine, --world_size "
              "processes)", file=sys.stderr)  # fmt: skip
        return 2
    if args.use_mpi:
        print("warning: --use_mpi: the ranks are started by torchrun (the same processes and environment)",
              file=sys.stderr)  # fmt: skip
    if args.use_deepspeed:
        if importlib.util.find_spec("deepspeed") is not None:
            return subprocess.call(_deepspeed_command(args))
        print("warning: --use_deepspeed: DeepSpeed is not installed; the ranks are started by torchrun (polyfuse's "
              "tensor parallelism shards the model either way)", file=sys.stderr)  # fmt: skip
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    settings.set_for_child(
        "OMP_NUM_THREADS", "1", overwrite=False
    )  # what torchrun sets for N > 1, without its warning
    launch = ["--nproc-per-node", str(args.world_size)]
    launch += ["--master-port", str(args.master_port)] if args.master_port else ["--standalone"]
    # The ranks print their own error line; torchrun's supervisor logs would repeat it as a page of text.
    for name, log in list(logging.root.manager.loggerDict.items()):
        if name.startswith(("torch.distributed.run", "torch.distributed.elastic")) and isinstance(log, logging.Logger):
            log.setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(launch + [args.script, *args.script_args]))
    except (KeyboardInterrupt, SignalException):  # Ctrl-C / SIGTERM: torchrun has already stopped the ranks
        return 130
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        if failure.exitcode > 0:
            return failure.exitcode
        print(f"error: rank {rank} ended by signal {-failure.exitcode}", file=sys.stderr)
        return 1
    return 0
