"""The tensor-parallel context: one process per device, started by torchrun (or examples/spawn.py, which runs
torchrun's machinery), joined into one process group whose backend follows the platform.

``init(device)`` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``),
creates the process group (NCCL on NVIDIA and ROCm, HCCL on Gaudi through ``habana_frameworks.torch.distributed.hccl``,
gloo on the CPU) and a one-dimensional ``DeviceMesh`` named "tp", and returns a :class:`TPContext`. A process
without ``WORLD_SIZE`` > 1 gets :data:`SINGLE` and nothing is initialized. ``shutdown()`` destroys the group.

A model is built tensor-parallel only when asked: ``build(..., tp=ctx)``, or, for the CLI, ``request_from_env()``
before the first build (the build's device then picks the backend). A training build is never sharded. The
communication variables the environment sets (``NCCL_NVLS_ENABLE``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST``) are left
as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from polyfuse.core import settings
from polyfuse.core.errors import CheckpointError, one_line
from polyfuse.core.platform import default_device_type
from polyfuse.distributed.sharding import TensorParallelError


logger = logging.getLogger("polyfuse")

# Process-group backend per device type (ROCm GPUs are device type "cuda": torch's "nccl" backend is RCCL there).
BACKENDS = {"cuda": "nccl", "hpu": "hccl", "cpu": "gloo"}
# Seconds a collective may wait for its peers before it fails (torchrun tears the job down sooner on a crash).
TIMEOUT_ENV = "POLYFUSE_DIST_TIMEOUT"


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup of the tensor-parallel ranks (None: single process)
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh, one dimension named "tp"
    device: Optional[torch.device] = None  # this rank's device
    backend: str = ""

    @property
    def active(self) -> bool:
        return self.world_size > 1


SINGLE = TPContext()

_context: Optional[TPContext] = None
_requested = False
_building: contextvars.ContextVar = contextvars.ContextVar("polyfuse_tp_building", default=SINGLE)


def world_size_from_env() -> int:
    try:
        return settings.get("WORLD_SIZE")
    except ValueError:
        return 1


def backend_for(device_type: str) -> str:
    """The process-group backend for a device type; on Gaudi importing Habana's hccl module registers it."""
    if device_type not in BACKENDS:
        raise TensorParallelError(f"tensor parallelism has no process-group backend for device type {device_type!r}")
    if device_type == "hpu":
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return BACKENDS[device_type]


def init(device=None) -> TPContext:
    """Join torchrun's world (once per process) and return the context; :data:`SINGLE` without ``WORLD_SIZE`` > 1.
    ``device``: the device type (or device) the model runs on; default: the platform's (hpu, cuda, cpu)."""
    global _context
    if _context is not None:
        return _context
    world = world_size_from_env()
    if world <= 1:
        _context = SINGLE
        return _context
    rank = settings.get("RANK")
    if rank is None:
        raise TensorParallelError(f"WORLD_SIZE={world} without RANK: start the ranks with torchrun")
    local = settings.get("LOCAL_RANK", rank)
    device_type = torch.device(device).type if device is not None else default_device_type()
    backend = backend_for(device_type)
    kwargs = {}
    if device_type == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        kwargs["device_id"] = dev  # the NCCL communicator exists before the first graph capture
    else:
        dev = torch.device(device_type)  # Gaudi: Habana's stack maps LOCAL_RANK to the process's one card
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=settings.get(TIMEOUT_ENV))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
        group = mesh.get_group("tp")
    except Exception as e:  # a device type DeviceMesh does not know: the world group is the TP group
        logger.info("polyfuse: no DeviceMesh for %s (%s); using the world process group", device_type, one_line(e))
        mesh, group = None, dist.group.WORLD
    _context = TPContext(dist.get_rank(), dist.get_world_size(), group, mesh, dev, backend)
    return _context


def request_from_env() -> None:
    """Build inference models tensor-parallel over torchrun's world (when ``WORLD_SIZE`` > 1), initializing the
    group at the first build, whose device picks the backend. What the CLI calls."""
    global _requested
    _requested = world_size_from_env() > 1


def current(device=None) -> TPContext:
    """The process's context: initialized already, or now when requested and ``device`` is known; else SINGLE."""
    if _context is not None:
        return _context
    if _requested and device is not None:
        return init(device)
    return SINGLE


def for_build(device, tp: Optional[TPContext] = None, training: bool = False) -> TPContext:
    """The context a model build uses: ``tp`` when given, else the process's (never for a training build)."""
    if tp is None:
        tp = SINGLE if training else current(device)
    if tp.active and training:
        raise TensorParallelError("tensor parallelism is for inference; build the model for training without tp")
    return tp


# shutdown() waits POLYFUSE_DESTROY_TIMEOUT_S for destroy_process_group: on 2 x H200 with NCCL, a decode benchmark's
# processes stayed in their teardown after printing every result; the callers then os._exit, abandoning it.


def shutdown() -> None:
    """After the last collective: wait for every rank, destroy the process group, forget the context. (Then end the
    process with ``os._exit``, as ``launch.distributed_entry`` does: with gloo, torch 2.13's interpreter teardown
    aborts now and then ("terminate called without an active exception") when the peer's exit races it.)

    The destroy runs in a daemon thread given POLYFUSE_DESTROY_TIMEOUT_S seconds: when it has not returned by then, one
    ``warning:`` line says so (with POLYFUSE_DESTROY_STACKS=1 also every thread's Python stack, for a report) and
    shutdown returns, so the caller's ``os._exit`` ends the process instead of a rank hanging at exit."""
    global _context, _requested
    if dist.is_available() and dist.is_initialized():
        import sys
        import threading

        try:
            dist.barrier()
        finally:
            done = threading.Thread(target=dist.destroy_process_group, name="destroy_process_group", daemon=True)
            done.start()
            wait_s = settings.get("POLYFUSE_DESTROY_TIMEOUT_S")
            done.join(wait_s)
            _context, _requested = None, False
        if done.is_alive():
            print(f"warning: destroy_process_group did not return in {wait_s:g} s; exiting without it",
                  file=sys.stderr, flush=True)  # fmt: skip
            if settings.get("POLYFUSE_DESTROY_STACKS"):
                import faulthandler

                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    _context, _requested = None, False


@contextlib.contextmanager
def building(tp: TPContext):
    """Modules constructed inside read their shard from :func:`building_context` (the decoder's layers do), so a
    family's own layer classes need no extra constructor argument."""
    token = _building.set(tp)
    try:
        yield tp
    finally:
        _building.reset(token)


def building_context() -> TPContext:
    return _building.get()


def agree(tp: TPContext, error: Optional[BaseException], fingerprint: str = "") -> None:
    """Every rank reports how its part went (a load: error or None, and what it loaded); raises on every rank when
    any failed or when they loaded different things, so no rank is left waiting in a collective a failed rank
    never joins. The same error everywhere is re-raised as is; another rank's error becomes
    ``CheckpointError("rank N: ...")`` on every rank."""
    if not tp.active:
        if error is not None:
            raise error
        return
    mine = (tp.rank, None if error is None else one_line(error), fingerprint)
    everyone: list = [None] * tp.world_size
    dist.all_gather_object(everyone, mine, group=tp.group)
    failed = [(r, msg) for r, msg, _ in everyone if msg is not None]
    if failed:
        if error is not None and len(failed) == tp.world_size and len({m for _, m in failed}) == 1:
            raise error
        rank, msg = failed[0]
        raise CheckpointError(f"rank {rank} of {tp.world_size}: {msg}")
    prints = {r: fp for r, _, fp in everyone}
    if len(set(prints.values())) > 1:
        odd = next(r for r, fp in prints.items() if fp != prints[0])
        raise CheckpointError(f"ranks disagree on the model: rank 0 loaded {prints[0]}, rank {odd} {prints[odd]}")
