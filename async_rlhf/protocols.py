"""The small interfaces between the parts. Backends implement them; the launcher wires them.

`actors/`, `learners/` and `buffer/` import these (and `types`, `config`), never each other.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # hints only: `status` and `--help` must not pay for importing torch
    import torch

    from async_rlhf.messages import SyncAddress as WeightSyncAddress
    from async_rlhf.weight_sync import UpdateMeta

from async_rlhf.types import Group, Prompt, Received, Sample, TrajectoryError


class GenerationEngine(Protocol):
    """Samples groups of n responses, by continuous batching: groups are submitted, come back
    from `step` as each one finishes, and new weights load in place between two steps."""

    @property
    def policy_version(self) -> int: ...

    @property
    def num_sequences(self) -> int:
        """Sequences submitted and not finished (a group's samples may finish apart)."""
        ...

    def submit(self, key: str, prompt: Prompt, n: int) -> None:
        """Start n samples of `prompt`; `step` returns them together under `key`."""
        ...

    def step(self) -> list[tuple[str, list[Sample]]]:
        """Advance every submitted group (by one engine step, or to its end where the engine
        cannot stop midway); returns (key, n samples) for each group that finished."""
        ...

    def abort(self, keys: Sequence[str]) -> None:
        """Drop submitted groups that have not finished."""
        ...

    def generate(self, prompts: Sequence[Prompt], n: int) -> list[list[Sample]]:
        """One list of n samples per prompt, log-probs under the sampling distribution (an
        idle engine: nothing submitted may be in flight)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full weights (HF names) held by the caller and sample with `version` from the
        next step on; groups in flight go on with the new weights."""
        ...

    # The weight-sync group (async_rlhf/weight_sync.py): the engine's processes that hold the
    # model (every vLLM worker) are its members, so updates from the learner load where they land.
    sync_ranks: int  # how many members (ranks) the engine adds to an epoch

    def join_weight_sync(self, address: WeightSyncAddress, rank: int, host: str) -> None:
        """Join an epoch as ranks rank .. rank + sync_ranks - 1, binding `host`, this node's
        address (blocks until the epoch forms)."""
        ...

    def receive_weights(self, meta: UpdateMeta, load: bool, keep: Iterable[int] = ()) -> int:
        """Take the update the learner is broadcasting now: load it (between two steps, as
        update_weights), or stage it for load_staged, letting go of staged versions not in
        `keep`. Returns the bytes received."""
        ...

    def load_staged(self, version: int) -> None:
        """Load a staged version as update_weights would; older staged ones are let go."""
        ...


class RewardFn(Protocol):
    """Scores responses. Raises, or returns NaN, for a response it cannot score."""

    name: str

    def __call__(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]: ...


@dataclass(frozen=True)
class QueueStats:
    """Counts of stream entries, i.e. of groups (one entry holds one whole group)."""

    backlog: int  # entries not yet delivered to any consumer
    pending: int  # delivered, not yet acknowledged
    dead_letters: int
    counters: dict[str, int]  # produced, trained, dropped_stale, dead_lettered, ...
    held: int = 0  # pending entries the learner trained, awaiting a checkpoint (ExperienceQueue.hold)
    learner_version: int = 0  # as the learner last recorded it (hold, learner_restarted)


class ExperienceQueue(Protocol):
    """A durable stream of groups with consumer-group delivery and acknowledgement.

    One entry holds one whole group (the scored samples of one prompt), so a group is
    delivered, trained, dropped or dead-lettered as one, and every count is of entries (groups).
    An entry leaves the system only by `ack` (trained, or dropped with a counted reason) or by
    `dead_letter` (malformed, with its reason).
    """

    def put(self, groups: Sequence[Group], timeout_s: float | None = None,
            prompt_position: int | None = None) -> None:
        """Append, one entry per group; blocks while the backlog is over the configured bound.
        `prompt_position`: the producer's prompt-stream position after these groups, kept
        with them (a restarted producer continues there)."""
        ...

    def prompt_positions(self) -> dict[str, int]:
        """Producer name -> prompt-stream position as of its last put."""
        ...

    def restore_prompt_positions(self, positions: dict[str, int]) -> None:
        """Set positions (from a checkpoint) for producers the stream has none for."""
        ...

    def get(self, count: int, block_ms: int = 1000) -> list[Received]:
        """Up to `count` entries for this consumer (reclaimed ones from dead consumers first)."""
        ...

    def ack(self, entry_ids: Sequence[str], reason: str = "trained") -> None:
        """Acknowledge entries and count them under `reason` (trained, dropped_stale, ...).
        Only entries this consumer still owns are acked and counted; the others (reclaimed
        by another consumer meanwhile) are counted as `ack_lost`."""
        ...

    def renew(self, entry_ids: Sequence[str]) -> list[str]:
        """Of `entry_ids`, those this consumer still owns, their reclaim timers reset.

        Delivery is at-least-once (an entry whose consumer dies or stalls past the claim
        timeout is delivered again to another); acknowledgement is exactly-once (ack, renew
        and dead-lettering act only on entries still owned). Training is exactly-once if the
        learner calls `renew` just before its optimizer step, trains only on the ids it
        returns, and acks them within the claim timeout of that call (see
        buffer/redis_stream.py)."""
        ...

    def hold(self, entry_ids: Sequence[str], version: int) -> list[str]:
        """The learner at `version` trained `entry_ids` and holds them, pending, until a
        checkpoint holds their update (then it acks them as trained): of them, those still
        owned, their reclaim timers reset without counting a delivery. Records `version` and
        the held count for the staleness gate (QueueStats), in one step with them."""
        ...

    def learner_restarted(self, version: int) -> None:
        """The learner (re)started from its checkpoint at `version`: nothing is held any more
        (what was held is pending, to be trained again)."""
        ...

    def duplicates(self, received: Sequence[Received]) -> list[str]:
        """The entry ids, of `received`, that copy a group id an earlier entry already carried
        (a producer that put a group twice): the learner acks them as `duplicate`, unused. An
        entry delivered again is no copy of itself."""
        ...

    def reject(self, rejected: Sequence[tuple[Received, TrajectoryError]]) -> None:
        """Set aside received entries that cannot be trained on (bytes and reason kept, counted
        `dead_lettered`): the learner's own checks, e.g. a token id outside its vocabulary."""
        ...

    def dead_letter(self, reason: str, detail: str, payload: bytes = b"") -> None:
        """Record something that will never be trained on (e.g. a group whose reward failed):
        `reason` is a short tag that is counted, `payload` opaque bytes (JSON from generators)."""
        ...

    def count_dropped(self, reason: str) -> None:
        """Count a group its producer dropped on purpose, never put: not bad data, so not
        dead-lettered (`uniform`: all its rewards were equal), as the counter dropped_<reason>."""
        ...

    def stats(self) -> QueueStats: ...


class AdmissionGate(Protocol):
    """The staleness gate as a generator sees it (async_rlhf.staleness.StalenessGate's rule;
    the launcher shares one gate between all generators)."""

    def try_admit(self, n: int) -> bool:
        """Reserve n samples of generation; False: wait for the learner to advance."""
        ...

    def finish(self, n_admitted: int, n_accepted: int) -> None:
        """Admitted samples ended (a group, or a batch): n_accepted of n_admitted were put on
        the queue."""
        ...


@dataclass(frozen=True)
class ReplayDraw:
    """What the replay buffer hands the learner for one step."""

    items: list[Received]  # train on these groups now
    first_use: list[str]  # entry ids trained for the first time: ack as "trained" after the step
    dropped: list[tuple[str, str]]  # (entry id, reason) evicted before any training: ack now


class ReplayBuffer(Protocol):
    """Learner-side store of whole groups: each may be trained on up to max_reuse times while
    its staleness (version - the group's oldest policy_version) stays within max_staleness;
    then it is evicted."""

    def add(self, items: Sequence[Received]) -> None: ...

    def draw(self, count: int, version: int) -> ReplayDraw:
        """Up to `count` groups usable at learner `version`, least-used and oldest first, none
        of them drawn before at this version (a step may draw several times to fill a batch)."""
        ...

    def __len__(self) -> int: ...


class WeightPublisher(Protocol):
    """Learner side of the weight sync: sends full weights, stamped with a version."""

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...


class TrainBackend(Protocol):
    """One data-parallel rank's models as the learner loop (learners/learner.py) uses them: the
    policy being trained, a frozen reference (when learner.kl_coef > 0), a critic (when
    learner.advantage is gae), their optimizers, the weights out and checkpoints.

    Tensors: input_ids, attention_mask [B, L]; positions [B, T], the index of the logit that
    predicts each response token. With world_size > 1, every rank calls step, full_state_dict and
    the checkpoint methods together (they are collective)."""

    rank: int
    world_size: int
    device: str  # where the batch goes: "cpu", "cuda:0", ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def has_reference(self) -> bool: ...

    @property
    def has_critic(self) -> bool: ...

    def logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, *,
                 reference: bool = False, with_entropy: bool = False,
                 entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log pi(response tokens) [B, T] at the generators' sampling temperature (the reference's
        with reference=True), and with with_entropy the entropy [B, T], which carries a gradient
        only with entropy_grad."""
        ...

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """Critic values [B, T] of the states before each response token."""
        ...

    def inference(self) -> AbstractContextManager[None]:
        """A context with the policy in eval mode and no gradients (the pi_prox, reference and
        critic passes); training mode again after."""
        ...

    def backward(self, loss: torch.Tensor, *, critic: bool = False) -> None:
        """Accumulate the gradient of this rank's share of the global loss (normalised by global
        counts, so the ranks' shares sum to the batch's loss) into the policy, or the critic."""
        ...

    def step(self, *, critic: bool = False) -> float | None:
        """Called after every micro-batch's backward: the optimizer steps once its micro-batches
        make up learner.batch_size / learner.minibatches samples (over all ranks), and returns the
        global gradient norm then, None before. A non-finite norm: the step was skipped, no weight
        or optimizer state changed and the gradients were dropped, on every rank."""
        ...

    def set_lr(self, lr: float) -> None:
        """The policy optimizer's learning rate from its next step on (the learner sets it every
        step, by learner.lr_schedule)."""
        ...

    def named_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full weight) for every policy parameter, where it lives and each valid only
        until the next is asked for (no copy: a weight update copies each into its bucket).
        Collective: every rank iterates to the end; only rank 0's tensors are meaningful."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's full weights copied to CPU under their HF names, on rank 0 ({} elsewhere)."""
        ...

    def save_checkpoint(self, ckpt_dir: str | os.PathLike, tag: str, client_state: dict) -> None:
        """Weights, optimizer state and client_state in ckpt_dir/<tag>/ (a critic's may go to
        ckpt_dir/critic/<tag>/), and ckpt_dir/latest holding the tag."""
        ...

    def load_checkpoint(self, ckpt_dir: str | os.PathLike) -> dict | None:
        """Restore the checkpoint ckpt_dir/latest names; its client_state, None if there is none."""
        ...

    def save_pretrained(self, out_dir: str | os.PathLike) -> None:
        """The policy as a Hugging Face model in out_dir (rank 0 writes; collective)."""
        ...
