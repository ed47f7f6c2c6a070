"""Fast checkpoint reads: safetensors tensors read straight from the file into their destination.

``safe_open(...).get_tensor`` copies a tensor out of the file into a new host tensor; a GPU load then copies that
pageable tensor again, synchronously. Here a tensor's bytes (known from the safetensors header: ``TensorSpan``) are
read with ``os.preadv`` directly into
  * the destination itself when it is a contiguous host tensor of the same dtype (one copy, page cache -> tensor);
  * a pinned staging buffer of the reading thread, then copied to the device without blocking on that thread's own
    stream, two buffers per thread so the next read overlaps the previous copy (``DeviceStager``).
Everything else (a dtype cast, a non-contiguous destination, a GGUF tensor) takes the plain path: read the tensor,
then ``dst.copy_``.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from polyfuse.core.errors import CheckpointError


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
}  # fmt: skip


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes lie in a safetensors file."""

    file: str
    start: int  # absolute byte offset in the file
    end: int
    dtype: Optional[torch.dtype]
    shape: tuple

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_spans(file: str) -> dict[str, TensorSpan]:
    """{name: TensorSpan} from a safetensors file's header (8-byte little-endian length, then JSON)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header ({type(e).__name__})") from None
    base = 8 + n
    return {
        name: TensorSpan(
            file,
            base + meta["data_offsets"][0],
            base + meta["data_offsets"][1],
            _DTYPES.get(meta["dtype"]),
            tuple(meta["shape"]),
        )  # fmt: skip
        for name, meta in header.items()
        if name != "__metadata__"
    }


class SpanReader:
    """Reads byte ranges of files with ``os.preadv``: one descriptor per file, shared by every thread (pread takes
    its offset explicitly). ``close()`` when the load is done."""

    def __init__(self):
        self.fds: dict = {}
        self.lock = threading.Lock()

    def _fd(self, file: str) -> int:
        fd = self.fds.get(file)
        if fd is None:
            with self.lock:
                fd = self.fds.get(file)
                if fd is None:
                    fd = self.fds[file] = os.open(file, os.O_RDONLY)
        return fd

    def pread_into(self, buf: torch.Tensor, file: str, offset: int) -> None:
        """Fill the contiguous host tensor ``buf`` (any dtype) with the file's bytes from ``offset``."""
        view = memoryview(buf.view(-1).view(torch.uint8).numpy())
        fd, done = self._fd(file), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{file}: truncated (wanted {len(view)} bytes at {offset})")
            done += n

    def close(self) -> None:
        with self.lock:
            for fd in self.fds.values():
                os.close(fd)
            self.fds.clear()


class DeviceStager:
    """Reads tensors into per-thread pinned buffers and copies them to ``device`` without blocking."""

    def __init__(self, device: torch.device, reader: SpanReader, chunk_bytes: int = 32 << 20):
        self.device, self.reader, self.chunk = device, reader, chunk_bytes
        self.local = threading.local()
        self.streams: list = []
        self.lock = threading.Lock()

    def _state(self):
        st = self.local.__dict__
        if not st:
            st["bufs"] = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            st["events"] = [None, None]
            st["stream"] = torch.cuda.Stream(self.device)
            st["i"] = 0
            with self.lock:
                self.streams.append(st["stream"])
        return st

    def load(self, span: TensorSpan, dst: torch.Tensor) -> None:
        st = self._state()
        out = dst.view(-1).view(torch.uint8)
        for o in range(0, span.nbytes, self.chunk):
            k = min(self.chunk, span.nbytes - o)
            i = st["i"]
            if st["events"][i] is not None:
                st["events"][i].synchronize()  # the copy that last used this buffer is done
            buf = st["bufs"][i][:k]
            self.reader.pread_into(buf, span.file, span.start + o)
            with torch.cuda.stream(st["stream"]):
                out[o : o + k].copy_(buf, non_blocking=True)
                ev = st["events"][i] = torch.cuda.Event()
                ev.record(st["stream"])
            st["i"] = 1 - i

    def finish(self) -> None:
        for s in self.streams:
            s.synchronize()


def copy_weight(dst: torch.Tensor, tensor, name: str, reader: SpanReader, stager: Optional[DeviceStager] = None):
    """Copy one checkpoint tensor (a tensor, or a reader callable that may carry a ``span``) into ``dst``."""
    span: Optional[TensorSpan] = getattr(tensor, "span", None)
    if span is not None:
        if span.shape != tuple(dst.shape):
            raise CheckpointError(f"weight {name!r} has shape {span.shape}, expected {tuple(dst.shape)}")
        direct = span.dtype == dst.dtype and dst.is_contiguous() and span.nbytes == dst.numel() * dst.element_size()
        if direct and dst.device.type == "cpu":
            reader.pread_into(dst, span.file, span.start)
            return
        if direct and stager is not None and dst.device.type == "cuda":
            stager.load(span, dst)
            return
    if callable(tensor):
        tensor = tensor()
    if tuple(dst.shape) != tuple(tensor.shape):
        raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)


def with_span(reader: Callable[[], torch.Tensor], span: TensorSpan) -> Callable[[], torch.Tensor]:
    reader.span = span
    return reader
