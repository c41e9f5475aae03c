"""The group codec: exact round trip, and a tagged TrajectoryError for every bad input."""

import dataclasses
import math

import msgpack
import numpy as np
import pytest

from async_rlhf.types import SCHEMA_VERSION, Group, Trajectory, TrajectoryError
from helpers import make_group, make_traj, reencoded
from buffer.codec import decode, encode


def one(**changes) -> Group:
    """A group of one trajectory, make_traj(**changes)."""
    return Group((make_traj(**changes),))


def assert_same(a: Group, b: Group) -> None:
    assert a.size == b.size
    for x, y in zip(a.members, b.members):
        for name in ("prompt_ids", "response_ids", "behavior_logprobs"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes(), name
        for name in ("reward", "reward_parts", "policy_version", "generator_id", "group_id",
                     "finished", "generated_at", "generation_s", "version_spans", "observation_spans",
                     "schema_version"):
            assert getattr(x, name) == getattr(y, name), name


def test_round_trip_keeps_every_field_exactly():
    group = make_group(size=3)
    back = decode(encode(group))
    assert_same(group, back)
    assert [t.schema_version for t in back.members] == [SCHEMA_VERSION] * 3
    assert not back.members[0].response_ids.flags.writeable  # arrays stay as produced


def test_round_trip_keeps_per_token_versions():
    """Tokens sampled by several versions (an in-flight update): the spans come back exactly,
    the oldest version is the staleness, and each token's version can be read off."""
    group = make_group(size=2, policy_version=4, version_spans=((4, 0), (5, 1), (7, 3)))
    back = decode(encode(group))
    assert_same(group, back)
    (t, _) = back.members
    assert t.version_spans == ((4, 0), (5, 1), (7, 3)) and type(t.version_spans[0]) is tuple
    assert t.token_versions().tolist() == [4, 5, 5, 7] and t.newest_version == 7
    assert back.policy_version == 4
    assert make_traj(policy_version=2).token_versions().tolist() == [2, 2, 2, 2]  # () = one version


def test_round_trip_keeps_the_tokens_an_environment_wrote():
    """An episode's observation tokens come back exactly, and only the model's are trained on."""
    group = make_group(size=2, observation_spans=((1, 3),))
    back = decode(encode(group))
    assert_same(group, back)
    assert back.members[0].loss_mask().tolist() == [True, False, False, True]
    assert make_traj().loss_mask().all()  # () = the model sampled every token


def test_round_trip_other_dtypes_and_byte_orders():
    group = one(
        prompt_ids=np.array([1, 2], dtype=">i8"),  # big-endian in, little-endian on the wire
        response_ids=np.array([3, 4], dtype=np.int64),
        behavior_logprobs=np.array([-1.0, -2.0], dtype=">f8"),
        reward_parts={},
    )
    (back,) = decode(encode(group)).members
    assert back.prompt_ids.tolist() == [1, 2] and back.prompt_ids.dtype == np.int64
    assert back.behavior_logprobs.tolist() == [-1.0, -2.0]
    assert back.behavior_logprobs.dtype == np.float64


def test_wire_format_is_a_plain_msgpack_map_with_little_endian_arrays():
    obj = msgpack.unpackb(encode(make_group(size=2)))
    assert obj.keys() == {"schema_version", "members"} and len(obj["members"]) == 2
    ids = obj["members"][1]["response_ids"]
    assert ids["dtype"] == "int32" and ids["shape"] == [4]
    assert np.frombuffer(ids["data"], "<i4").tolist() == [8, 9, 10, 2**31 - 1]


def test_group_properties_and_validation():
    group = Group((make_traj(0, policy_version=5), make_traj(1, group_id="group-0", policy_version=3)))
    assert (group.group_id, group.size, group.policy_version) == ("group-0", 2, 3)  # the oldest
    assert [t.policy_version for t in group.with_version(7).members] == [7, 7]
    bad = Group((make_traj(0), make_traj(1, group_id="group-0", reward=math.nan)))
    with pytest.raises(TrajectoryError, match="member 1 of group 'group-0': reward is nan") as info:
        bad.validate()
    assert info.value.reason == "non_finite_reward"


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
    assert reason_of(reencoded(make_group(), schema_version=SCHEMA_VERSION + 1)) == "schema"
    assert reason_of(reencoded(make_group(), schema_version=None)) == "missing_field"
    with pytest.raises(TrajectoryError, match="expects v4"):
        decode(reencoded(make_group(), schema_version=99))
    v1 = msgpack.unpackb(encode(one()))["members"][0]  # a v1 entry: one trajectory map
    assert reason_of(msgpack.packb({"schema_version": 1, **v1}, use_bin_type=True)) == "schema"
    v2 = msgpack.unpackb(encode(make_group()))  # a v2 entry: members without version_spans
    for member in v2["members"]:
        del member["version_spans"]
    assert reason_of(msgpack.packb({**v2, "schema_version": 2}, use_bin_type=True)) == "schema"
    v3 = msgpack.unpackb(encode(make_group()))  # a v3 entry: members without observation_spans
    for member in v3["members"]:
        del member["observation_spans"]
    assert reason_of(msgpack.packb({**v3, "schema_version": 3}, use_bin_type=True)) == "schema"


@pytest.mark.parametrize("field", ["reward", "response_ids", "group_id", "finished", "reward_parts"])
def test_missing_field(field):
    assert reason_of(reencoded(make_group(), member=2, **{field: None})) == "missing_field"


def test_missing_members():
    assert reason_of(reencoded(make_group(), members=None)) == "missing_field"


@pytest.mark.parametrize("member", [None, 0])
def test_unknown_field(member):
    assert reason_of(reencoded(make_group(), member=member, extra=1)) == "unknown_field"


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
        {"version_spans": [[1, 0, 2]]},
        {"version_spans": [[1.0, 0]]},
        {"version_spans": [[True, 0]]},
        {"version_spans": {"1": 0}},
        {"observation_spans": [[1, 2.0]]},
        {"observation_spans": [1, 2]},
    ],
)
def test_wrong_types(edits):
    assert reason_of(reencoded(make_group(), member=1, **edits)) == "field_type"


@pytest.mark.parametrize("members", [{"0": 1}, "abc", [1, 2]])
def test_members_must_be_a_list_of_maps(members):
    assert reason_of(reencoded(make_group(), members=members)) == "field_type"


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
    assert reason_of(reencoded(make_group(), member=3, response_ids=array)) == "array"


@pytest.mark.parametrize(
    "changes, reason",
    [
        (dict(reward=math.nan), "non_finite_reward"),
        (dict(reward=math.inf), "non_finite_reward"),
        (dict(behavior_logprobs=np.array([-1, math.nan, -1, -1], np.float32)), "non_finite_logprob"),
        (dict(behavior_logprobs=np.array([-1, -1, -math.inf, -1], np.float32)), "non_finite_logprob"),
        (dict(behavior_logprobs=np.array([-1.0, -2.0], np.float32)), "length_mismatch"),
        (dict(behavior_logprobs=np.array([-1, 0.5, -1, -1], np.float32)), "bad_logprob"),
        (dict(response_ids=np.array([], np.int32), behavior_logprobs=np.array([], np.float32)),
         "empty"),
        (dict(policy_version=-1), "bad_version"),
        (dict(group_id="another"), "group_id"),
        (dict(version_spans=((1, 1),)), "bad_version_spans"),  # the first span starts at 0
        (dict(version_spans=((1, 0), (2, 2), (3, 2))), "bad_version_spans"),  # starts rise
        (dict(version_spans=((1, 0), (2, 4))), "bad_version_spans"),  # past the response
        (dict(version_spans=((2, 0),)), "bad_version_spans"),  # policy_version is the oldest
        (dict(observation_spans=((2, 2),)), "bad_observation_spans"),  # empty
        (dict(observation_spans=((2, 5),)), "bad_observation_spans"),  # past the response
        (dict(observation_spans=((2, 4), (1, 2))), "bad_observation_spans"),  # not sorted
        (dict(observation_spans=((0, 2), (1, 3))), "bad_observation_spans"),  # overlapping
        (dict(observation_spans=((0, 4),)), "empty"),  # the model sampled no token
    ],
)
def test_validation_runs_after_decoding(changes, reason):
    """One bad member and the whole group is refused, with that member's reason."""
    group = make_group(size=3)
    bad = Group((group.members[0], dataclasses.replace(group.members[1], **changes), group.members[2]))
    assert reason_of(encode(bad)) == reason


def test_empty_group_is_refused():
    assert reason_of(encode(Group(()))) == "empty_group"


def test_encode_refuses_unsupported_dtypes():
    with pytest.raises(TrajectoryError, match="cannot be encoded"):
        encode(one(prompt_ids=np.array(["a"], dtype=object)))


def test_wire_bytes_are_what_msgpack_python_writes_for_the_documented_map():
    group = make_group(size=2, policy_version=1, version_spans=((1, 0), (2, 3)))
    arr = lambda a: {"dtype": a.dtype.name, "shape": list(a.shape), "data": a.tobytes()}  # noqa: E731
    documented = {"schema_version": 4, "members": [
        {"prompt_ids": arr(t.prompt_ids), "response_ids": arr(t.response_ids),
         "behavior_logprobs": arr(t.behavior_logprobs), "reward": t.reward,
         "reward_parts": t.reward_parts, "policy_version": t.policy_version,
         "generator_id": t.generator_id, "group_id": t.group_id, "finished": t.finished,
         "generated_at": t.generated_at, "generation_s": t.generation_s,
         "version_spans": [list(span) for span in t.version_spans],
         "observation_spans": [list(span) for span in t.observation_spans]}
        for t in group.members]}
    assert encode(group) == msgpack.packb(documented, use_bin_type=True)


def test_decoded_trajectory_has_every_dataclass_field():
    (back,) = decode(encode(one())).members
    assert vars(back).keys() == {f.name for f in dataclasses.fields(Trajectory)}
    assert back == dataclasses.replace(back)  # the constructor accepts what the decoder built


def outcome(fn, data):
    """A comparable summary of decoding `data`: the error reason, or the decoded fields."""
    try:
        group = fn(data)
        group.validate()
    except TrajectoryError as e:
        return ("error", e.reason)
    return ("ok", encode(group), tuple(type(getattr(t, f)) for t in group.members for f in sorted(vars(t))))


def _member_edit(**edits) -> bytes:
    return reencoded(make_group(size=2), member=1, **edits)


def _repeated_key() -> bytes:
    """A member map with "reward" twice (true, then its number): both decoders keep the last."""
    member = msgpack.packb(msgpack.unpackb(encode(one()))["members"][0], use_bin_type=True)
    assert member[0] == 0x8D  # a fixmap of 13 entries: make it 14, the first one repeated
    empty = msgpack.packb({"schema_version": SCHEMA_VERSION, "members": []}, use_bin_type=True)
    assert empty[-1] == 0x90  # an empty fixarray: make it hold one member
    return empty[:-1] + b"\x91" + b"\x8e\xa6reward\xc3" + member[1:]


EDGE_CASES = [
    encode(make_group()),
    encode(one(prompt_ids=np.zeros((2, 2), np.int32))),  # 2-D: decodes, validate refuses
    encode(one(behavior_logprobs=np.array([-1, -1, -1, -1], np.float16))),
    encode(Group(())),
    _member_edit(reward=True),
    _member_edit(reward=2),  # an int reward is a number
    _member_edit(generated_at=3),
    _member_edit(policy_version=1.0),
    _member_edit(policy_version=2**64 - 1),
    _member_edit(generator_id=b"gen"),
    _member_edit(reward_parts={"a": 1, "b": 2.5}),
    _member_edit(reward_parts={"a": False}),
    _member_edit(reward_parts={}),
    _member_edit(response_ids={"dtype": "int32", "shape": [4], "data": "abcdefghijklmnop"}),
    _member_edit(response_ids={"dtype": "int32", "shape": (2, 2), "data": b"\0" * 16}),
    _member_edit(response_ids={"dtype": "int32", "shape": [4], "data": b"\0" * 16, "x": 1}),
    _member_edit(behavior_logprobs={"dtype": "int32", "shape": [4], "data": b"\0" * 16}),
    _member_edit(prompt_ids={"dtype": "float64", "shape": [1], "data": b"\0" * 8}),
    _member_edit(prompt_ids={"dtype": "int32", "shape": [True], "data": b"\0" * 4}),
    _member_edit(version_spans=[[1, 0], [2, 2]]),  # member 1 has policy_version 1
    _member_edit(version_spans=[(1, 0)]),
    _member_edit(version_spans=[[1, 0], [0, 2]]),  # decodes, validate refuses
    _member_edit(version_spans=[[1, 0, 0]]),
    _member_edit(version_spans=[[1]]),
    _member_edit(version_spans=[[1.0, 0]]),
    _member_edit(version_spans=[[1, False]]),
    _member_edit(version_spans=[[2**64 - 1, 0]]),
    _member_edit(version_spans=[[-1, 0]]),
    _member_edit(version_spans=(1, 0)),
    _member_edit(version_spans=None),
    _member_edit(schema_version=SCHEMA_VERSION),  # only the entry has one
    reencoded(make_group(), schema_version=2.0),
    reencoded(make_group(), members=[]),
    reencoded(make_group(), members=(1,)),
    encode(make_group())[:-1],
    encode(make_group()) + b"\x00",
    msgpack.packb({**msgpack.unpackb(encode(make_group())), 1: 2}, use_bin_type=True),
    _repeated_key(),
]


@pytest.mark.parametrize("data", EDGE_CASES + [b"\xc1", b"\x80", msgpack.packb(None)])
def test_fast_decoder_agrees_with_the_checked_one(data):
    from buffer import codec

    assert outcome(codec.decode, data) == outcome(codec._decode_checked, data)
    for buffer_type in (bytearray, memoryview):
        assert outcome(codec.decode, buffer_type(data)) == outcome(codec._decode_checked, data)


def test_decoded_arrays_do_not_share_a_mutable_input_buffer():
    data = bytearray(encode(one()))
    (back,) = decode(data).members
    data[:] = b"\0" * len(data)
    assert back.response_ids.tolist() == [8, 9, 10, 2**31 - 1]
    assert not back.behavior_logprobs.flags.writeable


def test_decode_batch_is_decode_of_each():
    from buffer.codec import decode_batch

    good = [make_group(i, size=2, policy_version=i) for i in range(3)]

    def with_second(**changes) -> Group:  # a good group whose second member has `changes`
        first, second = make_group(size=2).members
        return Group((first, dataclasses.replace(second, **changes)))

    batch = [
        encode(good[0]),
        b"\xc1",
        encode(with_second(behavior_logprobs=np.array([-1, np.nan, -1, -1], np.float32))),
        encode(good[1]),
        # validate() finds the NaN log-prob before the NaN reward: so must the batch
        encode(with_second(reward=math.nan, behavior_logprobs=np.array([0.5, -1, -1, -1], np.float32))),
        encode(with_second(reward=math.nan)),
        # ... and a first member's bad log-prob before a second member's NaN reward
        encode(Group((make_traj(behavior_logprobs=np.array([-1, 0.5, -1, -1], np.float32)),
                      make_traj(1, group_id="group-0", reward=math.nan)))),
        # float16(1e-4) > 1e-4 in float32, yet <= 1e-4 as validate() compares it: kept
        encode(with_second(behavior_logprobs=np.array([1e-4, -1, -1, -1], np.float16))),
        encode(good[2]),
    ]
    got = decode_batch(batch)
    assert len(got) == len(batch)
    for data, result in zip(batch, got):
        assert outcome(lambda _: result if isinstance(result, Group) else _raise(result), data) \
            == outcome(decode, data)
    assert [type(r).__name__ for r in got] == ["Group", "TrajectoryError", "TrajectoryError",
                                               "Group", "TrajectoryError", "TrajectoryError",
                                               "TrajectoryError", "Group", "Group"]
    assert [r.reason for r in got if isinstance(r, TrajectoryError)] == [
        "garbage", "non_finite_logprob", "bad_logprob", "non_finite_reward", "bad_logprob"]
    assert decode_batch([]) == []
    assert [r.policy_version for r in decode_batch([encode(g) for g in good])] == [0, 1, 2]


def _raise(error):
    raise error
