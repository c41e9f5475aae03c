"""Helpers shared by test modules (tests/ is on sys.path under pytest)."""

import msgpack

from async_rlhf.types import Trajectory
from buffer.codec import encode


def reencoded(traj: Trajectory, **edits) -> bytes:
    """encode(traj) with map entries replaced (None: removed), as a buggy producer would."""
    obj = msgpack.unpackb(encode(traj))
    for key, value in edits.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    return msgpack.packb(obj, use_bin_type=True)
