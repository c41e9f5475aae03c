"""Group <-> bytes for the experience stream: a msgpack map, arrays as raw little-endian bytes.

Wire format (schema v4), one msgpack map per stream entry, holding one whole group:

    {"schema_version": 4,
     "members": [                       # the group's trajectories, in order
        {"prompt_ids": {"dtype": "int32", "shape": [P], "data": <P*4 bytes>},
         "response_ids": {...}, "behavior_logprobs": {"dtype": "float32", ...},
         "reward": float, "reward_parts": {str: float}, "policy_version": int,
         "generator_id": str, "group_id": str, "finished": bool,
         "generated_at": float, "generation_s": float,
         "version_spans": [[version, start], ...],    # ints; [] = policy_version throughout
         "observation_spans": [[start, end], ...]},   # ints; [] = the model sampled every token
        ...]}

(v3 had no observation_spans, v2 no version_spans; v1 was one trajectory map per entry, with
its own schema_version.)
Each decoded member's
`schema_version` is the entry's. Nothing is pickled: a decoder only ever builds numbers,
strings and numpy arrays of the dtypes listed in `_DTYPES`; decoded arrays are read-only.
`decode` raises TrajectoryError with a short reason tag ("garbage", "missing_field",
"field_type", "unknown_field", "schema", "array", then whatever `Group.validate` finds) so the
queue can dead-letter the entry under that reason.

Two decoders, one contract. The fast one (msgspec into the typed `_Wire` struct below: ~1 us a
member instead of ~8 us of msgpack-python plus per-field checks) accepts only well-formed v4
entries with 1-D arrays whose byte count matches their shape; anything else it hands to the
checked decoder, which is the reference: it accepts the same entries and names the reason for
the rest. tests/test_codec.py checks that the two agree on every malformed input it knows.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Annotated, Literal

import msgpack
import msgspec
import numpy as np

from async_rlhf.types import SCHEMA_VERSION, Group, Trajectory, TrajectoryError

# dtype name -> little-endian numpy dtype; integer ids and float log-probs only.
_DTYPES = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("int32", "int64", "uint32", "float16", "float32", "float64")
}
_IdDtype = Literal["int32", "int64", "uint32"]
_FloatDtype = Literal["float16", "float32", "float64"]
_ARRAYS = {  # field -> numpy kinds it may hold
    "prompt_ids": "iu",
    "response_ids": "iu",
    "behavior_logprobs": "f",
}
_NUMBER = frozenset((float, int))  # exact types: msgpack gives no subclasses, and bool is not a number
_SCALARS: dict[str, frozenset[type]] = {
    "reward": _NUMBER,
    "policy_version": frozenset((int,)),
    "generator_id": frozenset((str,)),
    "group_id": frozenset((str,)),
    "finished": frozenset((bool,)),
    "generated_at": _NUMBER,
    "generation_s": _NUMBER,
}
_SPANS = ("version_spans", "observation_spans")  # lists of integer pairs
_FIELDS = frozenset(_ARRAYS) | frozenset(_SCALARS) | {"reward_parts", *_SPANS}  # of a member map
_ENVELOPE = frozenset(("schema_version", "members"))


# The wire map as msgspec structs, fields in wire order. msgspec checks exact types as the
# checked decoder does (bool is not a number, float is not an int, str is not bytes), turns
# ints into floats where a float is declared, and refuses missing and unknown fields. gc=False:
# they hold no references that could form a cycle, so the collector need not track them.
class _Ids(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    dtype: _IdDtype
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data: bytes


class _Floats(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    dtype: _FloatDtype
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data: bytes


class _Member(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    prompt_ids: _Ids
    response_ids: _Ids
    behavior_logprobs: _Floats
    reward: float
    reward_parts: dict[str, float]
    policy_version: int
    generator_id: str
    group_id: str
    finished: bool
    generated_at: float
    generation_s: float
    version_spans: list[tuple[int, int]]
    observation_spans: list[tuple[int, int]]


class _Wire(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    schema_version: int
    members: list[_Member]


assert set(_Member.__struct_fields__) == _FIELDS and set(_Wire.__struct_fields__) == _ENVELOPE
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(_Wire)

# dtype -> (its name, whether its bytes need swapping to little-endian), for the native and
# both explicit byte orders (a dict lookup is ~10x faster than dtype.name and .byteorder).
_NAMES = {
    d: (name, not (d.byteorder == "<" or (d.byteorder == "=" and np.little_endian)))
    for name, le in _DTYPES.items() for d in (le, le.newbyteorder(">"), np.dtype(name))
}


def _pack_array(arr: np.ndarray, struct: type[_Ids] | type[_Floats]) -> _Ids | _Floats:
    name, swap = _NAMES.get(arr.dtype, (None, False))
    if name is None:
        raise TrajectoryError("array", f"dtype {arr.dtype} cannot be encoded; use one of {sorted(_DTYPES)}")
    if swap:
        arr = arr.astype(_DTYPES[name])
    # msgspec writes any contiguous buffer as msgpack bin, so the array goes out without a
    # tobytes() copy. (It does not check the dtype against the struct's Literal on encode; the
    # decoder does.)
    return struct(name, list(arr.shape), memoryview(np.ascontiguousarray(arr)))


def _pack_member(traj: Trajectory) -> _Member:
    return _Member(
        prompt_ids=_pack_array(traj.prompt_ids, _Ids),
        response_ids=_pack_array(traj.response_ids, _Ids),
        behavior_logprobs=_pack_array(traj.behavior_logprobs, _Floats),
        reward=float(traj.reward),
        reward_parts={str(k): float(v) for k, v in traj.reward_parts.items()},
        policy_version=int(traj.policy_version),
        generator_id=traj.generator_id,
        group_id=traj.group_id,
        finished=bool(traj.finished),
        generated_at=float(traj.generated_at),
        generation_s=float(traj.generation_s),
        version_spans=[(int(v), int(start)) for v, start in traj.version_spans],
        observation_spans=[(int(start), int(end)) for start, end in traj.observation_spans],
    )


def encode(group: Group) -> bytes:
    """The msgpack bytes of `group`, in this version's schema (not validated here: the
    consumer validates)."""
    return _ENCODER.encode(_Wire(SCHEMA_VERSION, [_pack_member(t) for t in group.members]))


# Trajectory is a frozen dataclass: its __init__ sets each of its 13 fields through
# object.__setattr__ (~1.3 us). Decoded fields are already exactly typed, so the decoder fills
# the instance dict directly (~0.2 us); this holds only while Trajectory has no __post_init__,
# no __slots__ and no field that the decoder does not set, which these lines check at import.
_TRAJECTORY_FIELDS = frozenset(f.name for f in dataclasses.fields(Trajectory))
assert _TRAJECTORY_FIELDS == _FIELDS | {"schema_version"} and not hasattr(Trajectory, "__post_init__")
assert "__dict__" in dir(Trajectory) and not hasattr(Trajectory, "__slots__")


def _decode_fast(data: bytes) -> Group | None:
    """The common case, fast: a well-formed v4 entry with 1-D arrays; None for anything else."""
    try:
        w = _DECODER.decode(data)
    except msgspec.DecodeError:  # also msgspec.ValidationError, its subclass
        return None
    if w.schema_version != SCHEMA_VERSION:
        return None
    members = []
    for m in w.members:
        arrays = []
        for arr in (m.prompt_ids, m.response_ids, m.behavior_logprobs):
            dtype = _DTYPES[arr.dtype]
            if len(arr.shape) != 1 or len(arr.data) != arr.shape[0] * dtype.itemsize:
                return None
            arrays.append(np.frombuffer(arr.data, dtype))  # read-only: msgspec made bytes
        traj = object.__new__(Trajectory)
        traj.__dict__.update(
            prompt_ids=arrays[0], response_ids=arrays[1], behavior_logprobs=arrays[2],
            reward=m.reward, reward_parts=m.reward_parts, policy_version=m.policy_version,
            generator_id=m.generator_id, group_id=m.group_id, finished=m.finished,
            generated_at=m.generated_at, generation_s=m.generation_s,
            version_spans=tuple(m.version_spans), observation_spans=tuple(m.observation_spans),
            schema_version=w.schema_version,
        )
        members.append(traj)
    return Group(tuple(members))


def _unpack_array(field: str, obj: object) -> np.ndarray:
    if not isinstance(obj, dict) or len(obj) != 3:
        raise TrajectoryError("field_type", f"{field} must be a map of dtype, shape, data")
    try:
        dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
    except KeyError as e:
        raise TrajectoryError("field_type", f"{field} has no {e.args[0]!r}") from None
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None or dtype.kind not in _ARRAYS[field]:
        raise TrajectoryError("array", f"{field} has dtype {dtype_name!r}, not allowed there")
    if type(data) is not bytes or type(shape) is not list:
        raise TrajectoryError("field_type", f"{field}: data must be bytes and shape a list")
    size = 1
    for n in shape:
        if type(n) is not int or n < 0:
            raise TrajectoryError("array", f"{field} has shape {shape}, not a list of sizes")
        size *= n
    if len(data) != size * dtype.itemsize:
        raise TrajectoryError(
            "array", f"{field} holds {len(data)} bytes but dtype {dtype_name} x shape {shape} "
            f"needs {size * dtype.itemsize}"
        )
    # A read-only view of the bytes msgpack just allocated: no second copy, and the frozen
    # trajectory's arrays cannot be changed by accident. Copy (`.astype(...)`, `torch.tensor`)
    # before writing; torch.from_numpy warns on it as is.
    arr = np.frombuffer(data, dtype=dtype)
    return arr if len(shape) == 1 else arr.reshape(shape)


def _check_keys(obj: dict, expected: frozenset[str], what: str) -> None:
    if obj.keys() != expected:
        missing, extra = sorted(expected - obj.keys()), sorted(obj.keys() - expected)
        if missing:
            raise TrajectoryError("missing_field", f"{what}: missing {missing} (unexpected: {extra})")
        raise TrajectoryError("unknown_field", f"{what}: unexpected fields {extra}")


def _member_checked(index: int, obj: object, version: int) -> Trajectory:
    """Member `index` of an entry, every field checked (not yet validated)."""
    what = f"member {index}"
    if not isinstance(obj, dict):
        raise TrajectoryError("field_type", f"{what} must be a map, got {type(obj).__name__}")
    _check_keys(obj, _FIELDS, what)
    for name, allowed in _SCALARS.items():
        if type(obj[name]) not in allowed:
            names = "/".join(sorted(t.__name__ for t in allowed))
            raise TrajectoryError("field_type", f"{what}: {name} must be {names}, got {obj[name]!r}")
    parts = obj["reward_parts"]
    if type(parts) is not dict or not all(
        type(k) is str and type(v) in _NUMBER for k, v in parts.items()
    ):
        raise TrajectoryError("field_type", f"{what}: reward_parts must map names to numbers, got {parts!r}")
    for name in _SPANS:
        spans = obj[name]
        if type(spans) is not list or not all(
            type(s) is list and len(s) == 2 and all(type(x) is int for x in s) for s in spans
        ):
            raise TrajectoryError("field_type", f"{what}: {name} must be a list of integer pairs, "
                                  f"got {spans!r:.80}")
    return Trajectory(
        prompt_ids=_unpack_array("prompt_ids", obj["prompt_ids"]),
        response_ids=_unpack_array("response_ids", obj["response_ids"]),
        behavior_logprobs=_unpack_array("behavior_logprobs", obj["behavior_logprobs"]),
        reward=float(obj["reward"]),
        reward_parts={k: float(v) for k, v in parts.items()},
        policy_version=obj["policy_version"],
        generator_id=obj["generator_id"],
        group_id=obj["group_id"],
        finished=obj["finished"],
        generated_at=float(obj["generated_at"]),
        generation_s=float(obj["generation_s"]),
        version_spans=tuple((v, start) for v, start in obj["version_spans"]),
        observation_spans=tuple((start, end) for start, end in obj["observation_spans"]),
        schema_version=version,
    )


def _decode_checked(data: bytes) -> Group:
    """The reference decoder (msgpack-python, every field checked): the group in `data`, not
    yet validated; raises TrajectoryError(reason, detail) for what it cannot be."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise TrajectoryError("garbage", f"not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise TrajectoryError("garbage", f"expected a msgpack map, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if type(version) is not int:
        raise TrajectoryError("missing_field", f"schema_version missing or not an int: {version!r}")
    if version != SCHEMA_VERSION:
        raise TrajectoryError(
            "schema",
            f"experience schema v{version} not understood by this version (expects "
            f"v{SCHEMA_VERSION}): run the same async-rlhf version everywhere",
        )
    _check_keys(obj, _ENVELOPE, f"a v{version} entry")
    members = obj["members"]
    if type(members) is not list:
        raise TrajectoryError("field_type", f"members must be a list of trajectory maps, got {members!r:.80}")
    return Group(tuple(_member_checked(i, m, version) for i, m in enumerate(members)))


def _decode_unvalidated(data: bytes) -> Group:
    # Either way the arrays view fresh bytes objects the decoder made, never `data` itself.
    return _decode_fast(data) or _decode_checked(data)


def decode(data: bytes) -> Group:
    """The group in `data`, checked; raises TrajectoryError(reason, detail) otherwise."""
    group = _decode_unvalidated(data)
    group.validate()
    return group


def _error_of(group: Group) -> TrajectoryError | None:
    try:
        group.validate()
    except TrajectoryError as e:
        return e
    return None


def decode_batch(payloads: Sequence[bytes]) -> list[Group | TrajectoryError]:
    """[decode(p) for p in payloads], with a TrajectoryError in place of each group that decode
    would refuse. The log-probs of the batch are checked in one numpy pass over their
    concatenation (~0.4 us a trajectory instead of ~1.8); only if that pass finds something
    wrong are the groups validated one by one, so each error is the one decode raises."""
    out: list[Group | TrajectoryError] = []
    logprobs = []
    for data in payloads:
        try:
            group = _decode_unvalidated(data)
        except TrajectoryError as e:
            out.append(e)
            continue
        try:
            group.validate(logprobs=False)
        except TrajectoryError:  # a full validate() may stop at an earlier check: its reason
            out.append(_error_of(group))
            continue
        out.append(group)
        logprobs += [t.behavior_logprobs for t in group.members]
    if logprobs:
        # Concatenating float16/32/64 is exact, and a comparison in the wider type only ever
        # fails more (float16(1e-4) > 1e-4): a false alarm just costs the slow pass below.
        flat = np.concatenate(logprobs)
        if not (flat.min() > -math.inf and flat.max() <= 1e-4):
            out = [r if type(r) is not Group else (_error_of(r) or r) for r in out]
    return out
