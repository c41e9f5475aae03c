"""Versioned weight broadcast from learner rank 0 to the generators' engines.

Each membership epoch (the learner plus the receiving processes of the moment: a generator's
vLLM workers, every tensor-parallel rank, or a process that stages updates) gets its own
standalone process group over a fresh TCPStore: gloo on CPU, NCCL on GPU. Groups cannot grow, so
a member joining or leaving means a new epoch.

Colocated (`placement: colocated`: every member on the learner's node and device) the bytes pass
by sharing instead (backend "ipc"): the learner packs each update straight into memory the
members open by a handle that the update's RPC carries, and no group forms. On CPU a bucket is a
memory file (memfd) each member maps through /proc/<learner pid>/fd, so it loads from the
learner's own copy; on GPU it is device memory shared by CUDA IPC (as vLLM's IPC weight-transfer
engine shares it), so no byte leaves the device. The learner keeps the newest update packed
either way, and a bucket is freed once neither that nor a send in flight holds it.

Addresses: the store listens on every interface of the learner's node (TCPStore does), at the
`host` it advertises, and each gloo member binds its own node's address (`host`), so an epoch
spans nodes. Only the epoch's members join: the group's keys live under a random per-epoch
secret (`SyncAddress.key`) that reaches them through Ray, never over the store.

The learner drives every transfer, and nothing is posted ahead of it. One update:

    learner -> each member, by RPC:  UpdateMeta (epoch, version, per bucket [(name, dtype, shape)])
    learner -> all, by broadcast:    one uint8 buffer per bucket, the tensors' raw bytes back to
                                     back (each padded to 8 bytes), sized by the meta on both sides

The RPC carries metadata only; the bytes travel only in the broadcasts. Tensors are packed into
flat buckets of about `bucket_mb`: one broadcast per bucket is 2-6x faster than one per tensor.

NCCL's rules, kept on gloo too so that one code shape runs on both:
- A group forms eagerly, when its epoch opens: every member checks in at the store, and a member
  missing after the timeout fails the formation (counted) instead of blocking the first update.
- No lock is held across a collective: formation runs in a thread of its own per epoch, and every
  send in the broadcaster's one sender thread; `open_epoch` and `publish` only swap state.
- No receive is posted between updates: a member enters a broadcast only when the learner's RPC
  for that update has reached it, so an idle generator GPU runs no spinning kernel.
- A member that dies breaks the current send: the learner's side raises (a closed connection, or
  the timeout; on NCCL, blocking wait with the communicator cleaned up and the process kept), the
  failure is counted, the group is aborted and the launcher forms the next epoch without the dead
  member while the learner goes on. A superseded epoch's group is destroyed.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import pickle
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from async_rlhf.messages import SyncAddress
from async_rlhf.procs import LOOPBACK, return_freed_memory

log = logging.getLogger(__name__)

_ALIGN = 8
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
Param = tuple[str, str, list[int]]  # name, dtype (str(torch.dtype)), shape
# On purpose, for the weight-sync groups: a failed or timed-out collective raises in the caller
# (blocking wait) and only cleans up the communicator; the default error handling (3) tears the
# whole process down, so a dead generator would take learner rank 0 with it.
_NCCL_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


MISFIT = "does not fit the generator's model"


class WeightMismatchError(RuntimeError):
    """An update that does not fit the receiving model: a name it does not know, a parameter it
    would leave unloaded, a shape that differs. Never transient: the job ends with it."""


def mismatch(version: int, unknown: Iterable[str] = (), unloaded: Iterable[str] = (),
             detail: str = "") -> WeightMismatchError:
    """The error for update `version`, naming (up to 8 of each of) the offending parameters."""
    def some(names: Iterable[str]) -> str:
        names = sorted(names)
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    parts = [f"names the model does not have: {some(unknown)}" if unknown else "",
             f"parameters it would leave unloaded: {some(unloaded)}" if unloaded else "", detail]
    return WeightMismatchError(f"weight update {version} {MISFIT} ({'; '.join(p for p in parts if p)}): "
                               "the learner and the generators must load the same model.path")


@dataclass(frozen=True)
class UpdateMeta:
    """What the learner's RPC tells each member ahead of one update's broadcasts: plain lists,
    so it crosses Ray, and vLLM's msgpack RPC into its workers, as it is."""

    epoch: int
    version: int
    buckets: list[list[Param]]  # one broadcast each, tensors in byte order
    # backend ipc: per bucket, the handle a member opens it by (open_shared); else None
    shared: list[str] | None = None

    def bucket_nbytes(self, i: int) -> int:
        return sum(_padded(_nbytes(dtype, shape)) for _, dtype, shape in self.buckets[i])


@dataclass(frozen=True)
class WeightUpdate:
    version: int
    named_tensors: list[tuple[str, torch.Tensor]]
    received_s: float  # seconds from the first byte to the last
    nbytes: int


@dataclass
class _Epoch:
    address: SyncAddress
    store: dist.TCPStore
    notify: Callable[[UpdateMeta], Callable[[], None]]  # RPC to the members; returns their wait
    group: object | None = None  # the process group, once formed (None with no rank but the learner's)
    formed: bool = False
    sent: int = -1  # the newest version its members have all taken
    broken: bool = False  # did not form, or a send failed: nothing more is sent on it
    sending: bool = False  # the sender thread is in a collective on it


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _device(backend: str) -> torch.device:
    gpu = backend == "nccl" or (backend == "ipc" and torch.cuda.is_available())
    return torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")


def _nbytes(dtype: str, shape: list[int]) -> int:
    return _DTYPES[dtype].itemsize * math.prod(shape)


def _padded(n: int) -> int:
    return n + (-n) % _ALIGN  # every tensor's offset stays aligned for the receiver's view()


def join_group(address: SyncAddress, store: dist.Store, rank: int, host: str):
    """Form the epoch's group now (eagerly): check in at the store, wait for every member until
    the timeout (then raise, naming who is missing), and connect; gloo binds `host`, this
    member's own node address."""
    timeout = timedelta(seconds=address.timeout_s)
    prefixed = dist.PrefixStore(f"weights/epoch{address.epoch}/{address.key}", store)
    prefixed.set(f"member{rank}", "1")
    keys = [f"member{r}" for r in range(address.world_size)]
    try:
        prefixed.wait(keys, timeout)
    except Exception as e:
        missing = [r for r in range(address.world_size) if not prefixed.check([f"member{r}"])]
        raise TimeoutError(f"weight-sync epoch {address.epoch}: ranks {missing} of {address.world_size} did "
                           f"not join {address.host}:{address.port} within {address.timeout_s:.0f}s") from e
    if address.backend != "nccl":
        gloo = dist.ProcessGroupGloo._Options()
        gloo._timeout = timeout
        # not gloo's default device, the hostname's address: that may be loopback (127.0.0.1 here)
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(prefixed, rank, address.world_size, gloo)  # connects here
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    saved = {k: os.environ.get(k) for k in _NCCL_ENV}
    os.environ.update(_NCCL_ENV)  # read by this group's constructor: the learner's other groups
    try:                          # keep their own settings
        group = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    group.eager_connect_single_device(_device("nccl"))  # init now, not at the first broadcast
    return group


def destroy_group(group) -> None:
    """Abort a group (a failed or superseded epoch's): its pending work fails, its sockets or
    communicators are freed."""
    try:
        group.abort()
    except Exception as e:  # noqa: BLE001 - already broken: nothing left to free
        log.debug("aborting a weight-sync group: %s", e)


def _broadcast(group, tensor: torch.Tensor) -> None:
    group.broadcast([tensor], dist.BroadcastOptions()).wait()


class Buckets(list):
    """Packed buckets in this process's memory (what `pack` fills)."""

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class SharedBuckets(Buckets):
    """Packed buckets that processes on this node open by handle (backend ipc), valid while this
    list lives: on CPU memory files (memfd) that members map through /proc/PID/fd, closed with
    the list; on `device` a GPU, device memory exported by CUDA IPC."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self._files: list[str] = []  # CPU: each bucket's /proc path and the file's inode
        self._fds: list[int] = []
        weakref.finalize(self, _close_fds, self._fds)

    def empty(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        fd = os.memfd_create("async-rlhf-weights", os.MFD_CLOEXEC)
        self._fds.append(fd)
        os.ftruncate(fd, nbytes)
        # the inode: a member that opens the path after this file closed, when its number may
        # name a newer bucket, refuses it rather than load another version's bytes
        self._files.append(f"/proc/{os.getpid()}/fd/{fd}@{os.fstat(fd).st_ino}")
        return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)

    def handles(self) -> list[str]:
        """Each bucket's handle, for one send. CUDA IPC exports are made per send: torch frees an
        exported block only once a member has opened and released it, so a version that is
        superseded before any member opens it is never exported."""
        if self.device.type != "cuda":
            return self._files
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize(self.device)  # the packing's copies are done before a member reads
        return [base64.b64encode(pickle.dumps(reduce_tensor(bucket)[1])).decode() for bucket in self]


def _close_fds(fds: list[int]) -> None:
    for fd in fds:  # the mappings (the learner's, and any member's) keep the memory until unmapped
        os.close(fd)


def open_shared(handle: str, nbytes: int, device: torch.device) -> torch.Tensor:
    """The first `nbytes` of a SharedBuckets bucket, opened by its handle: mapped read-only
    (copy-on-write) on CPU, no byte copied; on a GPU rebuilt from its CUDA IPC handle on this
    process's `device` (the same physical GPU)."""
    if handle.startswith("/proc/"):
        path, _, inode = handle.rpartition("@")
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise RuntimeError(f"weight bucket {path} could not be opened ({e}): backend ipc needs "
                               "every member on the learner's node, as the same user") from e
        try:
            if os.fstat(fd).st_ino != int(inode):
                raise RuntimeError(f"weight bucket {path} is no longer the one this update named: the "
                                   "learner let go of it (a later version was published)")
            return torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=nbytes, dtype=torch.uint8)
        finally:
            os.close(fd)  # the mapping keeps the memory
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(pickle.loads(base64.b64decode(handle)))
    args[6] = device.index  # the storage's device, as this process numbers it
    return rebuild_cuda_tensor(*args)[:nbytes]


def pack(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
         dtype: torch.dtype | None = None, out: Buckets | None = None) -> tuple[list[list[Param]], Buckets]:
    """Tensors as flat uint8 buckets of about bucket_bytes: (per bucket its params, the
    buckets). `dtype`: floating-point tensors are cast to it (the receiving engine's dtype) where
    they are, on the learner's device, before they leave it, so the host copy and the wire carry
    the engine's bytes. Each tensor is copied once, straight into its bucket: beyond the buckets
    themselves packing holds at most one cast tensor. A tensor over bucket_bytes gets a bucket
    of its own. Tensors are taken one at a time as the iterator yields them (a ZeRO-3 gather may
    free one as soon as the next is asked for). `out`: where the buckets go (SharedBuckets for
    backend ipc); default this process's memory."""
    metas: list[list[Param]] = [[]]
    buckets = Buckets() if out is None else out
    bucket = torch.empty(0, dtype=torch.uint8)
    used = 0
    for name, tensor in named_tensors:
        t = tensor.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        n = t.numel() * t.element_size()
        if used and used + n > bucket.numel():  # full: close it, trimmed to what it holds
            buckets.append(bucket[:used])
            metas.append([])
            used = 0
        if not used:
            bucket = buckets.empty(_padded(max(bucket_bytes, n)))
        if n:
            bucket[used:used + n].copy_(t.view(-1).view(torch.uint8))
        metas[-1].append((name, str(t.dtype), list(t.shape)))
        used = _padded(used + n)
    if metas[-1]:
        buckets.append(bucket[:used])
    else:
        metas.pop()
    return metas, buckets


def unpack(params: list[Param], data: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One bucket's tensors, as views into its bytes `data` (the inverse of pack)."""
    named, offset = [], 0
    for name, dtype, shape in params:
        n = _nbytes(dtype, shape)
        named.append((name, data[offset:offset + n].view(_DTYPES[dtype]).view(shape)))
        offset += _padded(n)
    return named


class WeightBroadcaster:
    """Learner rank 0's side (the WeightPublisher protocol).

    `open_epoch(world_size, notify)` returns the address the epoch's members join; the group
    forms in a thread of its own. `notify(meta)` is the launcher's RPC to every member of the
    epoch: it makes each one enter the update's broadcasts, and returns a function that waits
    for them all (raising if one failed). The last published version is kept packed, and a group
    that forms is sent it at once: a member that joins, or the survivors of one that died, catch
    up without waiting for the learner's next step, which may itself be waiting for their
    samples. Publishing with no formed group only packs (a ZeRO-3 gather is collective across
    learner ranks, so it happens anyway).
    """

    def __init__(self, host: str = LOOPBACK, backend: str | None = None,
                 bucket_mb: float = 64.0, timeout_s: float = 60.0, dtype: str | None = None):
        """`dtype`: the receiving engines' weight dtype (e.g. "bfloat16"), to which floating-point
        weights are cast before they are packed; None sends them as they come. `backend`: gloo,
        nccl or ipc (module doc); default nccl on a GPU, else gloo."""
        self.host = host
        self.backend = backend or default_backend()
        self.bucket_bytes = int(bucket_mb * 2**20)
        if dtype is not None and f"torch.{dtype}" not in _DTYPES:
            raise ValueError(f"weight-sync dtype must be one of {sorted(d[6:] for d in _DTYPES)} or None, got {dtype!r}")
        self.dtype = dtype and _DTYPES[f"torch.{dtype}"]
        self.timeout_s = timeout_s
        self._epoch = 0
        self._current: _Epoch | None = None
        self._last: tuple[int, list[list[Param]], Buckets] | None = None
        self._state = threading.Condition()  # guards the fields above; never held in a collective
        self._closed = False
        self.last_publish_s = 0.0  # the learner's share of the newest publish (packing)
        self.last_publish_bytes = 0  # the newest delivered update's
        self.failures = 0
        self.last_error = ""
        threading.Thread(target=self._send_loop, name="weights-send", daemon=True).start()

    @property
    def epoch(self) -> int:
        return self._epoch

    def open_epoch(self, world_size: int, notify: Callable[[UpdateMeta], Callable[[], None]]) -> SyncAddress:
        """Start epoch n+1 for `world_size` ranks (this is rank 0); the current one is let go."""
        with self._state:
            self._epoch += 1
            store = None if self.backend == "ipc" else dist.TCPStore(
                self.host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout_s))
            address = SyncAddress(self.host, store.port if store else 0, self._epoch, world_size, self.backend,
                                  key=secrets.token_hex(16), timeout_s=self.timeout_s)
            old, self._current = self._current, _Epoch(address, store, notify)
            epoch = self._current
        self._retire(old)
        threading.Thread(target=self._form, args=(epoch,), daemon=True, name=f"weights-epoch{address.epoch}").start()
        return address

    def _form(self, epoch: _Epoch) -> None:
        try:
            grouped = epoch.address.world_size > 1 and self.backend != "ipc"
            group = join_group(epoch.address, epoch.store, 0, self.host) if grouped else None
        except Exception as e:  # noqa: BLE001 - counted; the launcher forms the next epoch
            self._fail(epoch, f"{e}; the next membership epoch retries")
            return
        with self._state:
            epoch.group, epoch.formed = group, True
            self._state.notify_all()
        self._retire(epoch)  # if superseded while forming

    def _retire(self, epoch: _Epoch | None) -> None:
        """Destroy a superseded epoch's group, unless the sender is in a collective on it (the
        sender retires it when that ends)."""
        with self._state:
            if epoch is None or epoch is self._current or epoch.sending or epoch.group is None:
                return
            group, epoch.group, epoch.broken = epoch.group, None, True
        destroy_group(group)

    def _fail(self, epoch: _Epoch, message: str) -> None:
        with self._state:
            epoch.broken = True
            self._state.notify_all()
            if epoch is not self._current:  # superseded meanwhile: its failure changes nothing
                return
            self.failures += 1
            self.last_error = message
        log.error(message)

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Pack full weights stamped with `version` and hand them to the sender thread, which
        sends them to the current epoch's members while the learner goes on (`last_publish_s` is
        the learner's share: the packing). The host holds the newest version packed (in `dtype`),
        which a group that forms later is sent, and while a send of the previous one is under
        way, that one too; nothing else. A failure (a member died) is logged and counted,
        never raised: the launcher forms a new epoch, which then receives the newest version."""
        start = time.perf_counter()
        with self._state:  # the previous version's buckets go now (or once the sender ends with them)
            self._last = None
        out = SharedBuckets(_device(self.backend)) if self.backend == "ipc" else None
        metas, buckets = pack(named_tensors, self.bucket_bytes, self.dtype, out)
        with self._state:
            self._last = (version, metas, buckets)
            self._state.notify_all()
        self.last_publish_s = time.perf_counter() - start

    def _due(self) -> _Epoch | None:
        epoch = self._current
        if (epoch is None or not epoch.formed or epoch.broken or self._last is None
                or epoch.sent >= self._last[0]):
            return None
        return epoch

    def _send_loop(self) -> None:
        """The one thread that sends: the newest version to the current epoch, whenever it has
        not got it yet (a new group, or a new publish)."""
        while True:
            with self._state:
                self._state.wait_for(lambda: self._closed or self._due() is not None)
                if self._closed:
                    return
                epoch, (version, metas, buckets) = self._due(), self._last
                epoch.sending = True
                self._state.notify_all()
            shared = buckets.handles() if isinstance(buckets, SharedBuckets) else None
            self._send(epoch, UpdateMeta(epoch.address.epoch, version, metas, shared), buckets)
            del metas, buckets, shared  # sent: only self._last may hold it now

    def _send(self, epoch: _Epoch, meta: UpdateMeta, buckets: Buckets) -> None:
        device = _device(self.backend)
        try:
            members_done = epoch.notify(meta)  # members of no rank (that need only the version) too
            for bucket in buckets if epoch.group is not None else ():
                _broadcast(epoch.group, bucket.to(device))
            members_done()
        except Exception as e:  # noqa: BLE001 - a member died or failed: counted, the epoch aborted
            destroy_group(epoch.group)
            self._fail(epoch, f"weight broadcast of version {meta.version} in epoch {meta.epoch} failed: {e}")
            with self._state:
                epoch.sending, epoch.group = False, None
                self._state.notify_all()
            return
        with self._state:
            epoch.sent, epoch.sending = meta.version, False
            self.last_publish_bytes = sum(b.numel() for b in buckets)
            self._state.notify_all()
        self._retire(epoch)

    def close(self) -> None:
        with self._state:
            self._closed = True
            epoch, self._current = self._current, None
            self._state.notify_all()
        self._retire(epoch)


class WeightReceiver:
    """A member's side of one epoch: joins (forms the group) at construction, then `receive(meta)`
    takes one update when the learner's RPC brings its meta, and `close()` leaves. `host`: this
    member's own node address, which gloo binds (loopback unless the epoch spans nodes)."""

    def __init__(self, address: SyncAddress, rank: int, host: str = LOOPBACK):
        if not 0 < rank < address.world_size:
            raise ValueError(f"weight-sync member rank must be in 1..{address.world_size - 1}, got {rank}")
        self.address = address
        self._device = _device(address.backend)
        self._group = None  # backend ipc: nothing to join, updates bring their buckets' handles
        if address.backend != "ipc":
            self._store = dist.TCPStore(address.host, address.port, address.world_size, is_master=False,
                                        timeout=timedelta(seconds=address.timeout_s))
            self._group = join_group(address, self._store, rank, host)

    def receive(self, meta: UpdateMeta, to_host: bool = False) -> WeightUpdate:
        """Take one update; `to_host`: move each bucket to host memory as it lands (an update
        staged on a GPU then holds at most one bucket there, outside the engine's memory)."""
        if meta.epoch != self.address.epoch:
            raise RuntimeError(f"an update for weight-sync epoch {meta.epoch} reached a member of epoch "
                               f"{self.address.epoch}: the launcher must join members to the epoch first")
        named: list[tuple[str, torch.Tensor]] = []
        start, nbytes = time.perf_counter(), 0
        for i, params in enumerate(meta.buckets):
            if meta.shared:
                data = open_shared(meta.shared[i], meta.bucket_nbytes(i), self._device)
            else:
                data = torch.empty(meta.bucket_nbytes(i), dtype=torch.uint8, device=self._device)
                _broadcast(self._group, data)
            nbytes += data.numel()
            named += unpack(params, data.cpu() if to_host else data)
        return WeightUpdate(meta.version, named, time.perf_counter() - start, nbytes)

    def close(self) -> None:
        if self._group is not None:
            destroy_group(self._group)


class StagedReceiver:
    """A member's receiving end across epochs, held where the weights load (a vLLM worker, a
    transformers engine): it joins each epoch (leaving the previous one), and receives each
    update to load it at once, or to keep it by version until `load` picks it (an update that
    must wait for its safe point must not hold up the learner's broadcast)."""

    def __init__(self, load_fn: Callable[[list[tuple[str, torch.Tensor]], int], None]):
        self._load_fn = load_fn
        self._receiver: WeightReceiver | None = None
        # by version (the caller's `keep` lets go of those from before a learner restart)
        self._staged: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._lock = threading.Lock()  # receive and load may run in two threads
        self._joined = threading.Condition()  # a join and a receive may run in two threads too

    def join(self, address: SyncAddress, rank: int, host: str = LOOPBACK) -> None:
        with self._joined:
            old, self._receiver = self._receiver, None
        if old is not None:
            old.close()
        receiver = WeightReceiver(address, rank, host)
        with self._joined:
            self._receiver = receiver
            self._joined.notify_all()

    def receive(self, meta: UpdateMeta, load: bool, keep: Iterable[int] = (), wait_s: float = 60.0) -> int:
        """Take one update (the learner is broadcasting it now) and load it, or stage it, letting
        go of the staged versions not in `keep`; returns its bytes. The learner sends an epoch's
        first update once the group has formed, which may be before this member's join returns
        (they are calls in two threads): it waits up to `wait_s` for its join to that epoch."""
        with self._joined:
            joined = self._joined.wait_for(lambda: self._receiver is not None
                                           and self._receiver.address.epoch >= meta.epoch, wait_s)
            receiver = self._receiver
        if not joined:
            raise RuntimeError(f"weight update {meta.version} of epoch {meta.epoch} arrived, and this member "
                               f"had not joined that epoch within {wait_s:.0f} s")
        update = receiver.receive(meta, to_host=not load)
        if load:
            self._load_fn(update.named_tensors, update.version)
            nbytes, update = update.nbytes, None
            return_freed_memory()  # the update's tensors, freed, would stay in this process's heap
            return nbytes
        keep = set(keep)
        with self._lock:
            self._staged = {v: t for v, t in self._staged.items() if v in keep}
            self._staged[update.version] = update.named_tensors
        return update.nbytes

    def load(self, version: int) -> None:
        """Load staged `version`; older staged versions are let go."""
        with self._lock:
            if version not in self._staged:
                raise KeyError(f"weight version {version} is not staged here (staged: {sorted(self._staged)})")
            named_tensors = self._staged[version]
            self._staged = {v: t for v, t in self._staged.items() if v > version}
        self._load_fn(named_tensors, version)
        named_tensors = None
        return_freed_memory()

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        with self._lock:
            self._staged.clear()
