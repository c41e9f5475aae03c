"""The trajectory codec: exact round trip, and a tagged TrajectoryError for every bad input."""

import math

import msgpack
import numpy as np
import pytest

from async_rlhf.types import SCHEMA_VERSION, Trajectory, TrajectoryError
from helpers import reencoded
from buffer.codec import decode, encode


def make_traj(**changes) -> Trajectory:
    fields = dict(
        prompt_ids=np.array([5, 6, 7], dtype=np.int32),
        response_ids=np.array([8, 9, 10, 2**31 - 1], dtype=np.int32),
        behavior_logprobs=np.array([-0.5, -1.25, -3.0e-7, 0.0], dtype=np.float32),
        reward=0.75,
        reward_parts={"correct": 1.0, "length": -0.25},
        policy_version=7,
        generator_id="gen-3",
        group_id="prompt-42",
        finished=False,
        generated_at=1_796_000_000.123456,
        generation_s=0.0625,
    )
    fields.update(changes)
    return Trajectory(**fields)


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in ("prompt_ids", "response_ids", "behavior_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name
    for name in ("reward", "reward_parts", "policy_version", "generator_id", "group_id",
                 "finished", "generated_at", "generation_s", "schema_version"):
        assert getattr(a, name) == getattr(b, name), name


def test_round_trip_keeps_every_field_exactly():
    traj = make_traj()
    back = decode(encode(traj))
    assert_same(traj, back)
    assert back.schema_version == SCHEMA_VERSION
    assert not back.response_ids.flags.writeable  # a frozen trajectory's arrays stay as produced


def test_round_trip_other_dtypes_and_byte_orders():
    traj = make_traj(
        prompt_ids=np.array([1, 2], dtype=">i8"),  # big-endian in, little-endian on the wire
        response_ids=np.array([3, 4], dtype=np.int64),
        behavior_logprobs=np.array([-1.0, -2.0], dtype=">f8"),
        reward_parts={},
    )
    back = decode(encode(traj))
    assert back.prompt_ids.tolist() == [1, 2] and back.prompt_ids.dtype == np.int64
    assert back.behavior_logprobs.tolist() == [-1.0, -2.0]
    assert back.behavior_logprobs.dtype == np.float64


def test_wire_format_is_a_plain_msgpack_map_with_little_endian_arrays():
    obj = msgpack.unpackb(encode(make_traj()))
    assert obj["response_ids"]["dtype"] == "int32" and obj["response_ids"]["shape"] == [4]
    assert np.frombuffer(obj["response_ids"]["data"], "<i4").tolist() == [8, 9, 10, 2**31 - 1]


def reason_of(data: bytes) -> str:
    with pytest.raises(TrajectoryError) as info:
        decode(data)
    return info.value.reason


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xc1garbage", "garbage"),  # 0xc1 is never valid msgpack
        (b"", "garbage"),
        (msgpack.packb([1, 2, 3]), "garbage"),  # valid msgpack, not a map
        (msgpack.packb({"schema_version": 1}) + b"x", "garbage"),  # trailing bytes
    ],
)
def test_garbage(data, reason):
    assert reason_of(data) == reason


def test_schema_version():
    assert reason_of(reencoded(make_traj(), schema_version=SCHEMA_VERSION + 1)) == "schema"
    assert reason_of(reencoded(make_traj(), schema_version=None)) == "missing_field"
    with pytest.raises(TrajectoryError, match="expects v1"):
        decode(reencoded(make_traj(), schema_version=99))


@pytest.mark.parametrize("field", ["reward", "response_ids", "group_id", "finished", "reward_parts"])
def test_missing_field(field):
    assert reason_of(reencoded(make_traj(), **{field: None})) == "missing_field"


def test_unknown_field():
    assert reason_of(reencoded(make_traj(), extra=1)) == "unknown_field"


@pytest.mark.parametrize(
    "edits",
    [
        {"reward": "1.0"},
        {"policy_version": 1.5},
        {"policy_version": True},
        {"finished": 1},
        {"generator_id": 3},
        {"reward_parts": {"a": "x"}},
        {"reward_parts": [1.0]},
        {"response_ids": [1, 2]},
        {"response_ids": {"dtype": "int32", "shape": [1]}},
    ],
)
def test_wrong_types(edits):
    assert reason_of(reencoded(make_traj(), **edits)) == "field_type"


@pytest.mark.parametrize(
    "array",
    [
        {"dtype": "int32", "shape": [5], "data": b"\0" * 16},  # 16 bytes, shape needs 20
        {"dtype": "int32", "shape": [-4], "data": b"\0" * 16},
        {"dtype": "float32", "shape": [4], "data": b"\0" * 16},  # ids must be integers
        {"dtype": "object", "shape": [4], "data": b"\0" * 16},
    ],
)
def test_array_mismatch(array):
    assert reason_of(reencoded(make_traj(), response_ids=array)) == "array"


@pytest.mark.parametrize(
    "traj, reason",
    [
        (make_traj(reward=math.nan), "non_finite_reward"),
        (make_traj(reward=math.inf), "non_finite_reward"),
        (make_traj(behavior_logprobs=np.array([-1, math.nan, -1, -1], np.float32)),
         "non_finite_logprob"),
        (make_traj(behavior_logprobs=np.array([-1, -1, -math.inf, -1], np.float32)),
         "non_finite_logprob"),
        (make_traj(behavior_logprobs=np.array([-1.0, -2.0], np.float32)), "length_mismatch"),
        (make_traj(behavior_logprobs=np.array([-1, 0.5, -1, -1], np.float32)), "bad_logprob"),
        (make_traj(response_ids=np.array([], np.int32),
                   behavior_logprobs=np.array([], np.float32)), "empty"),
        (make_traj(policy_version=-1), "bad_version"),
    ],
)
def test_validation_runs_after_decoding(traj, reason):
    assert reason_of(encode(traj)) == reason


def test_encode_refuses_unsupported_dtypes():
    with pytest.raises(TrajectoryError, match="cannot be encoded"):
        encode(make_traj(prompt_ids=np.array(["a"], dtype=object)))


def test_wire_bytes_are_what_msgpack_python_writes_for_the_documented_map():
    traj = make_traj()
    arr = lambda a: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}  # noqa: E731
    documented = {
        "schema_version": 1, "prompt_ids": arr(traj.prompt_ids),
        "response_ids": arr(traj.response_ids), "behavior_logprobs": arr(traj.behavior_logprobs),
        "reward": 0.75, "reward_parts": {"correct": 1.0, "length": -0.25}, "policy_version": 7,
        "generator_id": "gen-3", "group_id": "prompt-42", "finished": False,
        "generated_at": 1_796_000_000.123456, "generation_s": 0.0625,
    }
    assert encode(traj) == msgpack.packb(documented, use_bin_type=True)


def test_decoded_trajectory_has_every_dataclass_field():
    import dataclasses

    back = decode(encode(make_traj()))
    assert vars(back).keys() == {f.name for f in dataclasses.fields(Trajectory)}
    assert back == dataclasses.replace(back)  # the constructor accepts what the decoder built


def outcome(fn, data):
    """A comparable summary of decoding `data`: the error reason, or the decoded fields."""
    try:
        traj = fn(data)
        traj.validate()
    except TrajectoryError as e:
        return ("error", e.reason)
    return ("ok", encode(traj), tuple(type(getattr(traj, f)) for f in sorted(vars(traj))))


EDGE_CASES = [
    encode(make_traj()),
    encode(make_traj(prompt_ids=np.zeros((2, 2), np.int32))),  # 2-D: decodes, validate refuses
    encode(make_traj(behavior_logprobs=np.array([-1, -1, -1, -1], np.float16))),
    reencoded(make_traj(), reward=True),
    reencoded(make_traj(), reward=2),  # an int reward is a number
    reencoded(make_traj(), generated_at=3),
    reencoded(make_traj(), policy_version=1.0),
    reencoded(make_traj(), policy_version=2**64 - 1),
    reencoded(make_traj(), generator_id=b"gen"),
    reencoded(make_traj(), reward_parts={"a": 1, "b": 2.5}),
    reencoded(make_traj(), reward_parts={"a": False}),
    reencoded(make_traj(), reward_parts={}),
    reencoded(make_traj(), response_ids={"dtype": "int32", "shape": [4], "data": "abcdefghijklmnop"}),
    reencoded(make_traj(), response_ids={"dtype": "int32", "shape": (2, 2), "data": b"\0" * 16}),
    reencoded(make_traj(), response_ids={"dtype": "int32", "shape": [4], "data": b"\0" * 16, "x": 1}),
    reencoded(make_traj(), behavior_logprobs={"dtype": "int32", "shape": [4], "data": b"\0" * 16}),
    reencoded(make_traj(), prompt_ids={"dtype": "float64", "shape": [1], "data": b"\0" * 8}),
    reencoded(make_traj(), prompt_ids={"dtype": "int32", "shape": [True], "data": b"\0" * 4}),
    reencoded(make_traj(), schema_version=1.0),
    encode(make_traj())[:-1],
    encode(make_traj()) + b"\x00",
    msgpack.packb({**msgpack.unpackb(encode(make_traj())), 1: 2}, use_bin_type=True),
    # a repeated key: both decoders keep the last value
    b"\x8d\xa6reward\xc3" + encode(make_traj())[1:],
]


@pytest.mark.parametrize("data", EDGE_CASES + [b"\xc1", b"\x80", msgpack.packb(None)])
def test_fast_decoder_agrees_with_the_checked_one(data):
    from buffer import codec

    assert outcome(codec.decode, data) == outcome(codec._decode_checked, data)
    for buffer_type in (bytearray, memoryview):
        assert outcome(codec.decode, buffer_type(data)) == outcome(codec._decode_checked, data)


def test_decoded_arrays_do_not_share_a_mutable_input_buffer():
    data = bytearray(encode(make_traj()))
    back = decode(data)
    data[:] = b"\0" * len(data)
    assert back.response_ids.tolist() == [8, 9, 10, 2**31 - 1]
    assert not back.behavior_logprobs.flags.writeable


def test_decode_batch_is_decode_of_each():
    from buffer.codec import decode_batch

    good = [make_traj(policy_version=i) for i in range(3)]
    batch = [
        encode(good[0]),
        b"\xc1",
        encode(make_traj(behavior_logprobs=np.array([-1, np.nan, -1, -1], np.float32))),
        encode(good[1]),
        # validate() finds the NaN log-prob before the NaN reward: so must the batch
        encode(make_traj(reward=math.nan, behavior_logprobs=np.array([0.5, -1, -1, -1], np.float32))),
        encode(make_traj(reward=math.nan)),
        # float16(1e-4) > 1e-4 in float32, yet <= 1e-4 as validate() compares it: kept
        encode(make_traj(behavior_logprobs=np.array([1e-4, -1, -1, -1], np.float16))),
        encode(good[2]),
    ]
    got = decode_batch(batch)
    assert len(got) == len(batch)
    for data, result in zip(batch, got):
        assert outcome(lambda _: result if isinstance(result, Trajectory) else _raise(result), data) \
            == outcome(decode, data)
    assert [type(r).__name__ for r in got] == ["Trajectory", "TrajectoryError", "TrajectoryError",
                                               "Trajectory", "TrajectoryError", "TrajectoryError",
                                               "Trajectory", "Trajectory"]
    assert decode_batch([]) == []
    assert [r.policy_version for r in decode_batch([encode(t) for t in good])] == [0, 1, 2]


def _raise(error):
    raise error
