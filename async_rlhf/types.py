"""The data path's messages, one frozen dataclass per hop (what the parts report about
themselves, metrics and stats, is in async_rlhf/messages.py).

prompts -> generator -> scorer -> experience queue -> learner -> weight broadcast -> generator
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

# Bump when a field is added, removed or changes meaning; the codec refuses other versions.
# v2: a stream entry holds a whole Group (v1 held one Trajectory).
# v3: each trajectory carries version_spans (which weights sampled which tokens).
# v4: each trajectory carries observation_spans (response tokens the model did not sample).
SCHEMA_VERSION = 4

# (version, index of the first response token that version sampled), one per change of weights
VersionSpans = tuple[tuple[int, int], ...]
# (start, end): response tokens [start, end) that an environment wrote (a multi-turn episode's
# observations and tool results), not the model: loss mask 0, behaviour log-prob 0
ObservationSpans = tuple[tuple[int, int], ...]


class TrajectoryError(ValueError):
    """A trajectory that must not be trained on; `reason` is a short machine-readable tag."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Prompt:
    """One prompt to generate for, with whatever its reward needs to score a response.

    `text` and `token_ids` are what the model sees (for a conversation: rendered with the chat
    template); `messages` is the conversation as the record gave it ({"role", "content"} maps,
    () for a plain-text prompt), for rewards that want it."""

    prompt_id: str
    token_ids: tuple[int, ...]
    text: str = ""
    answer: str = ""  # reference answer for verifiable rewards ("" when there is none)
    messages: tuple[dict[str, str], ...] = ()

    @property
    def query(self) -> str:
        """The user's words: the last user message of a conversation, else the text."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        return users[-1] if users else self.text


@dataclass(frozen=True)
class Sample:
    """One sampled response as the engine produced it.

    behavior_logprobs[i] is log pi_behaviour(response_ids[i] | prefix) under the distribution the
    token was actually sampled from (temperature and top-p applied).
    """

    response_ids: np.ndarray  # int32 [T]
    behavior_logprobs: np.ndarray  # float32 [T]
    finished: bool  # ended by EOS, an end-of-turn token or a stop string (False: cut at max_new_tokens)
    version_spans: VersionSpans  # the weights that sampled its tokens, as in Trajectory
    text: str = ""
    # An episode's (actors/episodes.py): tokens its environment wrote, as in Trajectory; the
    # environment's reward (None: the configured rewards score `text`, the transcript); why it
    # must be set aside, (reason, detail), when its environment failed.
    observation_spans: ObservationSpans = ()
    reward: float | None = None
    failure: tuple[str, str] | None = None
    # An agent's (actors/agents.py): its named reward parts, and the prompt its trajectory starts
    # from (its first call's, which the agent wrote), else None: the group's prompt.
    reward_parts: dict[str, float] = field(default_factory=dict)
    prompt_ids: np.ndarray | None = None

    @property
    def policy_version(self) -> int:
        """The oldest version that sampled a token of this sample."""
        return min(v for v, _ in self.version_spans)


@dataclass(frozen=True)
class Trajectory:
    """A scored sample: one member of a Group, one row of the learner's batch."""

    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [T]
    behavior_logprobs: np.ndarray  # float32 [T]
    reward: float  # weighted sum of reward_parts
    reward_parts: dict[str, float]
    policy_version: int  # the OLDEST version that sampled a token of it: what staleness is measured by
    generator_id: str
    group_id: str  # the n samples of one prompt share it
    finished: bool
    generated_at: float = field(default_factory=time.time)
    generation_s: float = 0.0  # seconds its group spent in the engine, submitted to finished
    # Which weights sampled which response tokens: (version, first token index) each time the
    # weights changed while it was generated (in-flight weight updates). The first span starts
    # at 0, starts rise strictly, and policy_version is the oldest of the versions. () means
    # one version, policy_version, sampled every token (producers that do not track it).
    version_spans: VersionSpans = ()
    # Response tokens an environment wrote (episodes: observations, tool results), sorted and
    # disjoint: never trained on (loss mask 0), behaviour log-prob 0. (): the model sampled all.
    observation_spans: ObservationSpans = ()
    schema_version: int = SCHEMA_VERSION

    def validate(self, *, logprobs: bool = True) -> None:
        """Raise TrajectoryError if this trajectory must not be trained on.

        logprobs=False skips the per-token log-prob checks (finite, <= 0), for a caller that
        checks many trajectories' log-probs in one numpy pass (buffer.codec.decode_batch) and
        calls validate() again on those that fail it, for the reason."""
        if self.schema_version != SCHEMA_VERSION:
            raise TrajectoryError(
                "schema",
                f"trajectory schema v{self.schema_version} not understood by this version "
                f"(expects v{SCHEMA_VERSION}): run the same async-rlhf version everywhere",
            )
        if self.response_ids.ndim != 1 or self.prompt_ids.ndim != 1:
            raise TrajectoryError("shape", "prompt_ids and response_ids must be 1-D")
        if len(self.response_ids) == 0:
            raise TrajectoryError("empty", "response has no tokens")
        if self.behavior_logprobs.shape != self.response_ids.shape:
            raise TrajectoryError(
                "length_mismatch",
                f"{len(self.behavior_logprobs)} behaviour log-probs for "
                f"{len(self.response_ids)} response tokens",
            )
        # min and max carry NaN, so one pass each finds NaN, inf and positive log-probs; which
        # of them it was is worked out only for a bad entry (the codec runs this on every entry
        # the learner reads)
        lp = self.behavior_logprobs
        if logprobs and not (lp.min() > -math.inf and lp.max() <= 1e-4):
            if not np.isfinite(lp).all():
                raise TrajectoryError("non_finite_logprob", "behaviour log-probs contain NaN or inf")
            raise TrajectoryError("bad_logprob", "behaviour log-probs must be <= 0")
        if not math.isfinite(self.reward):
            raise TrajectoryError("non_finite_reward", f"reward is {self.reward}")
        if self.policy_version < 0:
            raise TrajectoryError("bad_version", f"policy_version is {self.policy_version}")
        if self.version_spans:
            self._validate_spans()
        if self.observation_spans:
            self._validate_observations()

    def _validate_observations(self) -> None:
        ends = [0] + [x for span in self.observation_spans for x in span]
        if any(a > b for a, b in zip(ends, ends[1:])) or ends[-1] > len(self.response_ids) or any(
                start >= end for start, end in self.observation_spans):
            raise TrajectoryError("bad_observation_spans", f"observation spans {list(self.observation_spans)} "
                                  "must be non-empty, sorted, disjoint and within the response's "
                                  f"{len(self.response_ids)} tokens")
        if not self.loss_mask().any():
            raise TrajectoryError("empty", "every response token is an observation: the model sampled none")

    def loss_mask(self) -> np.ndarray:
        """bool [T]: the response tokens the model sampled (False: an observation's)."""
        mask = np.ones(len(self.response_ids), dtype=bool)
        for start, end in self.observation_spans:
            mask[start:end] = False
        return mask

    def _validate_spans(self) -> None:
        spans = self.version_spans
        starts = [s for _, s in spans]
        rising = all(a < b for a, b in zip(starts, starts[1:]))
        if starts[0] != 0 or not rising or starts[-1] >= len(self.response_ids):
            raise TrajectoryError("bad_version_spans", f"span starts {starts} must be 0 then rise "
                                  f"strictly below the response length {len(self.response_ids)}")
        oldest = min(v for v, _ in spans)
        if oldest != self.policy_version:
            raise TrajectoryError("bad_version_spans", f"policy_version {self.policy_version} is not "
                                  f"the oldest span version {oldest}: it must be (staleness is the "
                                  "oldest token's)")

    def token_versions(self) -> np.ndarray:
        """int64 [T]: the version of the weights that sampled each response token."""
        out = np.full(len(self.response_ids), self.policy_version, dtype=np.int64)
        for version, start in self.version_spans:
            out[start:] = version
        return out

    @property
    def newest_version(self) -> int:
        """The newest version that sampled a token of it (policy_version when one did all)."""
        return max((v for v, _ in self.version_spans), default=self.policy_version)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class Group:
    """The samples of one prompt (GRPO's n), scored: the unit from generation to loss.

    One stream entry holds one group, so a group reaches the learner whole or not at all, and
    is trained, dropped or dead-lettered as one: GRPO and RLOO baselines assume all n samples.
    """

    members: tuple[Trajectory, ...]

    @property
    def group_id(self) -> str:
        return self.members[0].group_id

    @property
    def policy_version(self) -> int:
        """The oldest member's version: the group's staleness is its stalest sample's."""
        return min(t.policy_version for t in self.members)

    @property
    def size(self) -> int:
        return len(self.members)

    def with_version(self, version: int, group_id: str | None = None) -> Group:
        """The same group with every member stamped `version` for all its tokens (benchmarks
        replay old data), and `group_id` if given (the learner refuses a second entry with the
        id of an earlier one as a duplicate: a replayed copy needs an id of its own)."""
        group_id = group_id or self.group_id
        return Group(tuple(dataclasses.replace(t, policy_version=version, version_spans=((version, 0),),
                                               group_id=group_id) for t in self.members))

    def validate(self, *, logprobs: bool = True) -> None:
        """Raise TrajectoryError if this group must not be trained on: it is empty, its
        members disagree on group_id, or a member fails Trajectory.validate (its reason; the
        detail names the member). logprobs: as in Trajectory.validate."""
        if not self.members:
            raise TrajectoryError("empty_group", "a group needs at least one trajectory")
        ids = {t.group_id for t in self.members}
        if len(ids) > 1:
            raise TrajectoryError(
                "group_id", f"members carry {len(ids)} group ids {sorted(ids)[:4]}: a group "
                "holds the samples of one prompt only (the producer mixed groups)",
            )
        for i, t in enumerate(self.members):
            try:
                t.validate(logprobs=logprobs)
            except TrajectoryError as e:
                raise TrajectoryError(e.reason, f"member {i} of group {t.group_id!r}: {e.detail}") from None


@dataclass(frozen=True)
class Received:
    """A group read from the experience queue, with the stream entry id to acknowledge it by."""

    entry_id: str
    group: Group
