"""One weight update of a preset's model from a learner process to a member process that loads it
(copies every tensor into a model of its own, as an engine's load does): broadcast over gloo
against the colocated pass through shared memory (weight_sync backend ipc). Prints, per
backend, the bytes per update, the seconds from publish to the member's load done (median of
`--updates`), and the host memory the update holds: both processes' proportional set size (PSS:
pages shared between them count once in all) above their models, when the member has loaded it.

    python scripts/bench_weight_pass.py --preset small --updates 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import psutil
import torch


def _pss() -> int:
    return psutil.Process().memory_full_info().pss


def _member(address, commands, acks, preset):
    from async_rlhf.synthetic import build_model
    from async_rlhf.weight_sync import WeightReceiver

    model = dict(build_model(preset).named_parameters())
    base = _pss()
    receiver = WeightReceiver(address, 1)
    while (meta := commands.get()) is not None:
        update = receiver.receive(meta)
        with torch.no_grad():
            for name, tensor in update.named_tensors:
                model[name].copy_(tensor)
        acks.put(_pss() - base)  # while the update is held
    receiver.close()


def measure(backend: str, preset: str, updates: int) -> dict:
    from async_rlhf.synthetic import build_model
    from async_rlhf.weight_sync import WeightBroadcaster

    weights = list(build_model(preset).named_parameters())
    base = _pss()
    ctx = mp.get_context("spawn")
    commands, acks = ctx.Queue(), ctx.Queue()
    sender = WeightBroadcaster(backend=backend, timeout_s=120)
    held = []  # (the member's, the learner's) PSS above the model as each update is loaded

    def notify(meta):
        commands.put(meta)
        return lambda: held.append((acks.get(timeout=120), _pss() - base))

    address = sender.open_epoch(2, notify)
    member = ctx.Process(target=_member, args=(address, commands, acks, preset), daemon=True)
    member.start()
    seconds = []
    for version in range(1, updates + 1):
        start = time.perf_counter()
        sender.publish(weights, version)
        with sender._state:
            sender._state.wait_for(lambda: sender._current.sent >= version, 120)
        seconds.append(time.perf_counter() - start)
    commands.put(None)
    member.join(60)
    sender.close()
    member_extra, learner_extra = max(held, key=sum)
    return {"backend": backend, "bytes": sender.last_publish_bytes, "seconds": statistics.median(seconds),
            "learner_extra": learner_extra, "member_extra": member_extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["gloo", "ipc"])
    args = parser.parse_args()
    for backend in args.backends:
        r = measure(backend, args.preset, args.updates)
        print(f"{r['backend']:5s} {r['bytes'] / 2**20:7.1f} MiB an update, {r['seconds']:.3f} s publish to loaded "
              f"(median of {args.updates}); held beyond the models (PSS): learner {r['learner_extra'] / 2**20:.0f} MiB "
              f"+ member {r['member_extra'] / 2**20:.0f} MiB = {(r['learner_extra'] + r['member_extra']) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
