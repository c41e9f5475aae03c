"""Helpers shared by test modules (tests/ is on sys.path under pytest): the one trajectory and
group factory of the codec, queue and replay tests, a buggy producer's re-encoding, and the
admission gate of the generator tests."""

import msgpack
import numpy as np

from async_rlhf.types import Group, Trajectory
from buffer.codec import encode


def make_traj(i: int = 0, **changes) -> Trajectory:
    """Trajectory number i: every field set, most of them different from its neighbours'."""
    fields = dict(
        prompt_ids=np.array([5, 6, 7], dtype=np.int32) + i,
        response_ids=np.array([8, 9, 10, 2**31 - 1], dtype=np.int32),
        behavior_logprobs=np.array([-0.5, -1.25, -3.0e-7, 0.0], dtype=np.float32),
        reward=0.75 + i,
        reward_parts={"correct": 1.0 + i, "length": -0.25},
        policy_version=i % 3,
        generator_id=f"gen-{i % 2}",
        group_id=f"group-{i // 4}",
        finished=bool(i % 2),
        generated_at=1_796_000_000.123456 + i,
        generation_s=0.0625,
    )
    fields.update(changes)
    return Trajectory(**fields)


def make_group(g: int = 0, size: int = 4, **changes) -> Group:
    """Group number g: trajectories g * size ... g * size + size - 1 with group id "group-<g>";
    `changes` apply to every member."""
    return Group(tuple(make_traj(g * size + j, **{"group_id": f"group-{g}", **changes})
                       for j in range(size)))


def reencoded(group: Group, *, member: int | None = None, **edits) -> bytes:
    """encode(group) with map entries replaced (None: removed), as a buggy producer would: in
    the entry's map, or with member=i in that member's map."""
    obj = msgpack.unpackb(encode(group))
    target = obj if member is None else obj["members"][member]
    for key, value in edits.items():
        if value is None:
            del target[key]
        else:
            target[key] = value
    return msgpack.packb(obj, use_bin_type=True)


class EngineGate:
    """The AdmissionGate protocol over StalenessGate, keyed on the engine's weights version (what
    the launcher's gate does through its coordinator)."""

    def __init__(self, gate, version_fn):
        self.gate, self.version_fn = gate, version_fn

    def try_admit(self, n):
        return self.gate.try_admit(n, self.version_fn())

    def finish(self, n_admitted, n_accepted):
        self.gate.finish(n_admitted, n_accepted)
