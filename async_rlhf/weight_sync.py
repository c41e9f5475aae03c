"""Versioned weight broadcast from learner rank 0 to the generators.

Each membership epoch (the learner plus the generators of the moment) gets its own standalone
process group over a fresh TCPStore: gloo on CPU, NCCL on GPU. Groups cannot grow, so a generator
joining or leaving means a new epoch; the old one is closed with a CLOSE header.

Wire format of one publish, all broadcasts from rank 0:

    for each bucket:  header int64[4] = (BUCKET, version, meta_nbytes, data_nbytes)
                      meta  uint8[meta_nbytes]   msgpack [(name, dtype, shape), ...]
                      data  uint8[data_nbytes]   the tensors' raw bytes, back to back
    then:             header int64[4] = (END, version, 0, 0)

Tensors are packed into flat byte buckets of about `bucket_mb` (one broadcast per bucket is 2-6x
faster than one per tensor) and streamed, so a ZeRO-3 learner never holds more than one bucket
beyond the shard it gathers.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

BUCKET, END, CLOSE = 1, 2, 3
_ALIGN = 8
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class SyncAddress:
    """Where the members of one epoch meet."""

    host: str
    port: int
    epoch: int
    world_size: int  # learner + generators
    backend: str  # "gloo" or "nccl"


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    named_tensors: list[tuple[str, torch.Tensor]]
    received_s: float  # seconds from the first header to the last byte
    nbytes: int
    received_at: float = field(default_factory=time.time)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _make_group(address: SyncAddress, store: dist.Store, rank: int, timeout_s: float):
    prefixed = dist.PrefixStore(f"weights/epoch{address.epoch}", store)
    timeout = timedelta(seconds=timeout_s)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    return dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


class WeightBroadcaster:
    """Learner rank 0's side (the WeightPublisher protocol).

    `open_epoch` returns the address the epoch's generators join; the group forms in the
    background and replaces the old one at the next `publish`. Publishing with no generator
    still consumes the tensors (a ZeRO-3 gather is collective across learner ranks).
    """

    def __init__(self, host: str = "127.0.0.1", backend: str | None = None,
                 bucket_mb: float = 64.0, timeout_s: float = 120.0):
        self.host = host
        self.backend = backend or default_backend()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self._epoch = 0
        self._group = None
        self._stores: list[dist.TCPStore] = []  # the current and the pending epoch's store
        self._pending: tuple[SyncAddress, threading.Thread, list] | None = None
        self._lock = threading.Lock()
        self.last_publish_s = 0.0
        self.last_publish_bytes = 0
        self.failures = 0
        self.last_error = ""

    @property
    def epoch(self) -> int:
        return self._epoch

    def open_epoch(self, world_size: int) -> SyncAddress:
        """Start epoch n+1 for `world_size` members (this learner is rank 0)."""
        with self._lock:
            self._close_group()
            self._epoch += 1
            store = dist.TCPStore(self.host, 0, world_size, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.timeout_s))
            address = SyncAddress(self.host, store.port, self._epoch, world_size, self.backend)
            result: list = []

            def form() -> None:
                try:
                    result.append(_make_group(address, store, 0, self.timeout_s))
                except Exception as e:  # a member never came; reported at the next publish
                    result.append(e)

            thread = threading.Thread(target=form, name=f"weights-epoch{self._epoch}", daemon=True)
            thread.start()
            self._stores = self._stores[-1:] + [store]
            self._pending = (address, thread, result)
            return address

    def _switch_to_pending(self) -> None:
        address, thread, result = self._pending
        self._pending = None
        thread.join(self.timeout_s + 5)
        if not result or isinstance(result[0], Exception):
            raise RuntimeError(
                f"weight-sync epoch {address.epoch}: not all {address.world_size} members joined "
                f"{address.host}:{address.port} within {self.timeout_s}s "
                f"({result[0] if result else 'timeout'}); the next membership epoch retries"
            )
        self._group = result[0] if address.world_size > 1 else None

    def _close_group(self) -> None:
        """Tell the current members this epoch is over (they then join the next one)."""
        if self._group is not None:
            try:
                _broadcast(self._group, torch.tensor([CLOSE, -1, 0, 0], dtype=torch.int64,
                                                     device=_device(self.backend)))
            except Exception as e:  # a member died: the others see the group break instead
                log.warning("closing weight-sync epoch %d: %s", self._epoch, e)
            self._group = None

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> bool:
        """Broadcast full weights stamped with `version` to the current epoch's generators.

        A failure (a member died, one never joined) is logged and counted, never raised: the
        learner keeps training and the launcher forms a new epoch. Returns whether it was sent.
        """
        with self._lock:
            start = time.perf_counter()
            try:
                if self._pending is not None:
                    self._switch_to_pending()
                if self._group is None:
                    for _ in named_tensors:
                        pass
                    return False
                self.last_publish_bytes = self._send(named_tensors, version)
                return True
            except Exception as e:
                self._group = None  # broken: wait for the next epoch
                self.failures += 1
                self.last_error = str(e)
                log.error("weight broadcast of version %d failed: %s", version, e)
                return False
            finally:
                self.last_publish_s = time.perf_counter() - start

    def _send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        device = _device(self.backend)
        total = 0
        for meta, chunks in _buckets(named_tensors, self.bucket_bytes):
            meta_bytes = msgpack.packb(meta)
            data = torch.cat(chunks).to(device)
            header = torch.tensor([BUCKET, version, len(meta_bytes), data.numel()], dtype=torch.int64)
            _broadcast(self._group, header.to(device))
            _broadcast(self._group, torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(device))
            _broadcast(self._group, data)
            total += data.numel()
        _broadcast(self._group, torch.tensor([END, version, 0, 0], dtype=torch.int64, device=device))
        return total

    def close(self) -> None:
        with self._lock:
            self._close_group()
            self._pending = None
            self._stores = []


def _buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[tuple[list, list]]:
    """Group tensors into (meta, [uint8 chunks]) of about bucket_bytes each."""
    meta: list = []
    chunks: list[torch.Tensor] = []
    size = 0
    for name, tensor in named_tensors:
        t = tensor.detach().contiguous().cpu()
        meta.append((name, str(t.dtype), list(t.shape)))
        raw = t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        chunks.append(raw)
        if raw.numel() % _ALIGN:  # keep every tensor's offset aligned for the receiver's view()
            chunks.append(torch.zeros(_ALIGN - raw.numel() % _ALIGN, dtype=torch.uint8))
        size += raw.numel()
        if size >= bucket_bytes:
            yield meta, chunks
            meta, chunks, size = [], [], 0
    if meta:
        yield meta, chunks


class WeightReceiver:
    """A generator's side of one epoch: `receive()` blocks until the next full update.

    Returns None when the learner closed the epoch (a new one follows).
    """

    def __init__(self, address: SyncAddress, rank: int, timeout_s: float = 24 * 3600.0):
        if not 0 < rank < address.world_size:
            raise ValueError(f"generator rank must be in 1..{address.world_size - 1}, got {rank}")
        self.address = address
        self._store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False,
                                    timeout=timedelta(seconds=120))
        self._group = _make_group(address, self._store, rank, timeout_s)
        self._device = _device(address.backend)

    def _recv(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, device=self._device)
        _broadcast(self._group, t)
        return t

    def receive(self) -> WeightUpdate | None:
        named: list[tuple[str, torch.Tensor]] = []
        nbytes = 0
        start = None
        while True:
            kind, version, meta_n, data_n = self._recv(4, torch.int64).tolist()
            start = start or time.perf_counter()
            if kind == CLOSE:
                return None
            if kind == END:
                return WeightUpdate(version, named, time.perf_counter() - start, nbytes)
            if kind != BUCKET:
                raise RuntimeError(f"weight sync: unexpected header kind {kind} (protocol mismatch)")
            meta = msgpack.unpackb(self._recv(meta_n, torch.uint8).cpu().numpy().tobytes())
            data = self._recv(data_n, torch.uint8)
            nbytes += data_n
            offset = 0
            for name, dtype, shape in meta:
                dt = _DTYPES[dtype]
                n = dt.itemsize * math.prod(shape)
                named.append((name, data[offset:offset + n].view(dt).view(shape)))
                offset += n + (-n) % _ALIGN
