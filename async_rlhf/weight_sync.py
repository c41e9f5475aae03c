"""Versioned weight broadcast from learner rank 0 to the generators.

Each membership epoch (the learner plus the generators of the moment) gets its own standalone
process group over a fresh TCPStore: gloo on CPU, NCCL on GPU. Groups cannot grow, so a generator
joining or leaving means a new epoch; the old one is closed with a CLOSE header.

Addresses: the store listens on every interface of the learner's node (TCPStore does), at the
`host` it advertises, and each gloo member binds its own node's address (`host`), so an epoch
spans nodes. Only the epoch's members join: the group's keys live under a random per-epoch
secret (`SyncAddress.key`) that reaches them through Ray, never over the store.

Wire format of one publish, all broadcasts from rank 0:

    for each bucket:  header int64[4] = (BUCKET, version, meta_nbytes, data_nbytes)
                      meta  uint8[meta_nbytes]   msgpack [(name, dtype, shape), ...]
                      data  uint8[data_nbytes]   the tensors' raw bytes, back to back
    then:             header int64[4] = (END, version, 0, 0)

Tensors are packed into flat byte buckets of about `bucket_mb`: one broadcast per bucket is 2-6x
faster than one per tensor.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

from async_rlhf.procs import LOOPBACK

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
    key: str  # the epoch's secret: the group's store prefix, which only its members know


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    named_tensors: list[tuple[str, torch.Tensor]]
    received_s: float  # seconds from the first header to the last byte
    nbytes: int


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _make_group(address: SyncAddress, store: dist.Store, rank: int, timeout_s: float, host: str):
    """This member's group of the epoch; gloo binds `host`, the member's own node address."""
    prefixed = dist.PrefixStore(f"weights/epoch{address.epoch}/{address.key}", store)
    timeout = timedelta(seconds=timeout_s)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # not gloo's default device, the hostname's address: that may be loopback (127.0.0.1 here)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, address.world_size, options)


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


class WeightBroadcaster:
    """Learner rank 0's side (the WeightPublisher protocol).

    `open_epoch` returns the address the epoch's generators join; the group forms in the
    background. The last published version is kept packed (one copy of the weights), and a group
    sends it as soon as it has formed: a generator that joins, or the survivors of one that died,
    catch up at once instead of waiting for the learner's next step, which may itself be waiting
    for their samples. Publishing with no group only packs (a ZeRO-3 gather is collective across
    learner ranks, so it happens anyway). Thread-safe: open_epoch may run during a learner step.
    """

    def __init__(self, host: str = LOOPBACK, backend: str | None = None,
                 bucket_mb: float = 64.0, timeout_s: float = 120.0):
        self.host = host
        self.backend = backend or default_backend()
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self._epoch = 0
        self._group = None
        self._store: dist.TCPStore | None = None  # the newest epoch's (clients need it alive)
        self._last: tuple[int, list[tuple[bytes, torch.Tensor]]] | None = None
        self._lock = threading.Lock()
        self.last_publish_s = 0.0
        self.last_publish_bytes = 0
        self.failures = 0
        self.last_error = ""

    @property
    def epoch(self) -> int:
        return self._epoch

    def open_epoch(self, world_size: int) -> SyncAddress:
        """Close the current epoch and start epoch n+1 for `world_size` members (this is rank 0)."""
        with self._lock:
            self._close_group()
            self._epoch += 1
            self._store = dist.TCPStore(self.host, 0, world_size, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout_s))
            address = SyncAddress(self.host, self._store.port, self._epoch, world_size, self.backend,
                                  key=secrets.token_hex(16))
        threading.Thread(target=self._form, args=(address, self._store), daemon=True,
                         name=f"weights-epoch{address.epoch}").start()
        return address

    def _form(self, address: SyncAddress, store: dist.TCPStore) -> None:
        try:
            group = (_make_group(address, store, 0, self.timeout_s, self.host)
                     if address.world_size > 1 else None)
        except Exception as e:
            with self._lock:
                self._fail(f"weight-sync epoch {address.epoch}: not all {address.world_size} members "
                           f"joined {address.host}:{address.port} within {self.timeout_s:.0f}s ({e}); "
                           "the next membership epoch retries")
            return
        with self._lock:
            if address.epoch == self._epoch:  # not superseded meanwhile
                self._group = group
                if self._last is not None:
                    self._send_last()

    def _fail(self, message: str) -> None:
        self._group = None
        self.failures += 1
        self.last_error = message
        log.error(message)

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

        A failure (a member died) is logged and counted, never raised: the learner keeps training
        and the launcher forms a new epoch, which then receives this version. Returns whether it
        was sent now.
        """
        start = time.perf_counter()
        packed = [(msgpack.packb(meta), torch.cat(chunks))
                  for meta, chunks in _buckets(named_tensors, self.bucket_bytes)]
        with self._lock:
            self._last = (version, packed)
            sent = self._group is not None and self._send_last()
        self.last_publish_s = time.perf_counter() - start
        return sent

    def _send_last(self) -> bool:
        version, packed = self._last
        device = _device(self.backend)
        try:
            for meta_bytes, data in packed:
                header = torch.tensor([BUCKET, version, len(meta_bytes), data.numel()], dtype=torch.int64)
                _broadcast(self._group, header.to(device))
                _broadcast(self._group, torch.frombuffer(bytearray(meta_bytes), dtype=torch.uint8).to(device))
                _broadcast(self._group, data.to(device))
            _broadcast(self._group, torch.tensor([END, version, 0, 0], dtype=torch.int64, device=device))
        except Exception as e:
            self._fail(f"weight broadcast of version {version} in epoch {self._epoch} failed: {e}")
            return False
        self.last_publish_bytes = sum(data.numel() for _, data in packed)
        return True

    def close(self) -> None:
        with self._lock:
            self._close_group()
            self._epoch += 1  # a group still forming is dropped
            self._store = None


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

    Returns None when the learner closed the epoch (a new one follows). `host`: this member's
    own node address, which gloo binds (loopback unless the epoch spans nodes).
    """

    def __init__(self, address: SyncAddress, rank: int, timeout_s: float = 24 * 3600.0,
                 host: str = LOOPBACK):
        if not 0 < rank < address.world_size:
            raise ValueError(f"generator rank must be in 1..{address.world_size - 1}, got {rank}")
        self.address = address
        self._store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False,
                                    timeout=timedelta(seconds=120))
        self._group = _make_group(address, self._store, rank, timeout_s, host)
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
