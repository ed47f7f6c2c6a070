"""Tensor-parallel serving: rank 0 schedules and speaks HTTP; every other rank runs the same steps.

Each step's batches (runner.StepBatch: host tensors) are broadcast from rank 0 over a gloo group of their own
before rank 0 runs them, so every rank calls the model's paged step with the same inputs and its all-reduces meet
(the model is split as for generation: docs/distributed.md). While idle rank 0 sends a heartbeat every second, so a
follower's wait never reaches the group's timeout; when it stops it sends ``None`` and the followers return.
"""

from __future__ import annotations

import datetime
import signal

import torch.distributed as dist

from polyfuse.core import settings


IDLE, STOP = "idle", None


class StepChannel:
    def __init__(self):
        timeout = datetime.timedelta(seconds=settings.get("POLYFUSE_DIST_TIMEOUT"))
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.rank = dist.get_rank()

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, value):
        """Rank 0's ``value`` on every rank (the engine's configuration: every rank allocates the same cache)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def follow(runner, channel: StepChannel) -> None:
    """A follower's loop: run each step rank 0 sends until it says stop. SIGTERM (torchrun forwards it to every
    rank) is left to rank 0, which drains and then stops the followers."""
    signal.signal(signal.SIGTERM, lambda *_: None)
    while True:
        message = channel.receive()
        if message is STOP:
            return
        if message == IDLE:
            continue
        runner.run(message)
