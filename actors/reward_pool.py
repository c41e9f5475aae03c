"""Reward calls in worker processes, so that a call that hangs can be ended with all it holds.

A thread cannot be killed: a reward call abandoned in one keeps its thread, its memory and
whatever socket or lock it waits on for the rest of the job. Here each call runs in one of
`size` worker processes (spawned, so that no thread of the engine's process is forked); a call
that has not answered by its deadline gets its process killed, and a new process takes the
slot at the next call. At most `size` calls run at once; a caller waits for a free worker.
A worker dies with the process that started it (PR_SET_PDEATHSIG), hung or not. The kernel ties
that signal to the thread that started the worker: start() and call() run in threads that live
as long as the pool is used (a generator's run, an actor's task threads), and close() ends the
workers before those threads do. Workers are spawned: a script that builds a pool needs an
`if __name__ == "__main__":` guard, as vLLM's spawned engines do.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from queue import SimpleQueue

from async_rlhf.protocols import RewardFn
from async_rlhf.types import Prompt

START_S = 120.0  # the most a worker may take to start (import the rewards' modules, load models)
_PR_SET_PDEATHSIG = 1


def _serve(conn: Connection, rewards: list[RewardFn], parent: int) -> None:
    """A worker's loop: (index, prompts, responses) in, a list or a (reason, detail) out."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle, not ours
    conn.send("ready")
    while True:
        try:
            index, prompts, responses = conn.recv()
        except EOFError:  # the parent closed the pool
            return
        reward = rewards[index]
        try:
            out = list(reward(prompts, responses))
        except Exception as e:  # noqa: BLE001 - any reward bug is the samples' failure
            out = ("reward_raised", f"{reward.name}: {type(e).__name__}: {e}")
        try:
            conn.send(out)
        except Exception as e:  # noqa: BLE001 - values that do not pickle
            conn.send(("reward_bad_output", f"{reward.name} returned values that cannot be sent: {e}"))


class _Worker:
    def __init__(self, context, rewards: list[RewardFn]):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, rewards, os.getpid()),
                                       name="reward-worker", daemon=True)
        self.process.start()
        child.close()
        self.is_ready = False  # its "ready" received

    def ready(self) -> _Worker:
        """Wait until the worker has loaded the rewards (START_S at most)."""
        if self.is_ready:
            return self
        try:
            if self.conn.poll(START_S):
                self.conn.recv()
                self.is_ready = True
                return self
            why = f"did not start within {START_S:g} s"
        except EOFError:
            why = "exited while starting (its error is logged above)"
        self.kill()
        raise RuntimeError(f"a reward worker process {why}: check that the reward targets import "
                           "and their models load")

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool:
    """`size` worker processes, each holding a copy of `rewards`, started on first use."""

    def __init__(self, rewards: Sequence[RewardFn], size: int):
        if size < 1:
            raise ValueError(f"a reward pool needs at least one worker, got size={size}")
        self.rewards, self.size = list(rewards), size
        self.killed = 0  # workers killed at a deadline, or found dead
        self._context = multiprocessing.get_context("spawn")
        self._free: SimpleQueue[_Worker | None] = SimpleQueue()  # None: a slot with no process yet
        for _ in range(size):
            self._free.put(None)
        self._lock = threading.Lock()  # guards killed

    def call(self, index: int, prompts: Sequence[Prompt], responses: Sequence[str], deadline_s: float):
        """rewards[index](prompts, responses) as a list, or a (reason, detail) failure:
        reward_raised, reward_timeout (its worker killed past deadline_s)."""
        name = self.rewards[index].name
        worker = self._free.get()
        try:
            worker = (worker or _Worker(self._context, self.rewards)).ready()
            worker.conn.send((index, list(prompts), list(responses)))
            if worker.conn.poll(deadline_s):
                out = worker.conn.recv()
                self._free.put(worker)
                return out
            failure = ("reward_timeout", f"{name} took longer than {deadline_s:g} s (its process was killed)")
        except (EOFError, OSError) as e:  # the worker died: the reward crashed or exited it
            failure = ("reward_raised", f"{name}: its worker process died ({type(e).__name__}: {e})")
        except BaseException:  # e.g. KeyboardInterrupt: the worker may still be busy
            self._end(worker)
            raise
        self._end(worker)
        with self._lock:
            self.killed += 1
        return failure

    def _end(self, worker: _Worker | None) -> None:
        if worker is not None:
            worker.kill()
        self._free.put(None)

    def spawn(self) -> None:
        """Start the workers that are not running, all at once, without waiting for them: they
        load the rewards while the caller goes on (start() or a call waits for them)."""
        slots = [self._free.get() for _ in range(self.size)]
        for worker in slots:
            self._free.put(worker or _Worker(self._context, self.rewards))

    def start(self) -> None:
        """Start the workers that are not running, all at once, and wait until they are ready
        (else each starts at its first call, which then waits for it)."""
        self.spawn()
        workers = [self._free.get() for _ in range(self.size)]
        try:
            for worker in workers:
                worker.ready()
        except BaseException:
            for worker in workers:
                self._end(worker)
            raise
        for worker in workers:
            self._free.put(worker)

    def close(self) -> None:
        """Stop every worker (new ones start at the next call); call it when no call runs."""
        for _ in range(self.size):
            worker = self._free.get()
            if worker is not None:
                worker.kill()
            self._free.put(None)
