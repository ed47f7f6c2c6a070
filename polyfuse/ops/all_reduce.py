"""Sum a tensor over the ranks of a tensor-parallel group: the one collective of a tensor-parallel decoder (after
each row-parallel projection, and to assemble the vocab-parallel logits).

``all_reduce(x, group) -> x summed over group``; the reference sums in place with ``torch.distributed.all_reduce``
and returns ``x``; ``group`` None (a single process) returns ``x`` untouched. A model at world size 1 never calls
the op at all (no op in its step or graph).

Why in-place ``dist.all_reduce`` rather than the functional collectives: the result is the caller's own plain
tensor, so the kernels that read it next (Triton add+RMSNorm reads raw pointers) see finished data on the current
stream (the NCCL work is joined to it before the call returns), nothing is allocated per call, and it is captured
as is by CUDA graphs with NCCL (ProcessGroupNCCL enqueues no watchdog work while a stream captures; the communicator
is created at ``init_process_group(device_id=...)``, before any capture) and by HPU graphs with HCCL. torch.compile
traces it through its in-place-collective remapping. The functional ``all_reduce`` returns an
``AsyncCollectiveTensor`` that waits only when a torch op touches it, which a raw-pointer kernel does not. A backend
may register a faster implementation (a one-shot NVLink all-reduce for decode sizes): it must work with NVLink
multicast off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` on the lent machines).
"""

from typing import Any

import torch

from polyfuse.core.registry import OpSpec, declare


def all_reduce_native(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    if group is None:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=group)
    return x


SPEC = declare(
    OpSpec(
        "all_reduce",
        "all_reduce(x[...] contiguous, group: ProcessGroup | None) -> x summed over the group's ranks (in place)",
        all_reduce_native,
        training=False,
    )
)
