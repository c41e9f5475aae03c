"""The learner loop: stream -> replay -> decoupled-PPO step on a TrainBackend -> weights out.

How data-parallel ranks split the data: rank 0 is the only consumer of the experience stream
and the only owner of the replay buffer and the weight publisher. Each step it draws whole
groups (one stream entry each) holding exactly `batch_size` trajectories, packs them into
tensors and broadcasts them to every rank, so all ranks see the same global batch: group
advantages (GRPO, RLOO) are computed on the whole batch, so a group never straddles ranks for
its statistics, and loss normalisers are global counts. Rank r then trains rows [r*n, (r+1)*n)
of each minibatch (n = batch / (minibatches * ranks)).
A group is the unit from the stream to the loss: every group in a batch has exactly
`group_size` members (a group of another size is rejected to the dead-letter stream as
`group_size`, never split or padded), and staleness drops, rejects and acks act on whole
groups; `groups`, `group_size_min` and `groups_singleton` in the metrics show it.
Only rank 0 acks. The launcher starts one Learner per rank; ranks other than 0 get queue=None,
replay=None, publisher=None.

Per step (one policy version): wait for a batch (dropping, with an ack and a count, anything
staler than max_staleness) -> recompute pi_prox (and reference, critic) on each rank's rows
(pi_prox only when the batch takes several optimizer steps or feeds a KL reward; otherwise it
is the training forward's own log-probs, detached) -> advantages ->
`minibatches` optimizer steps of micro-batches, at the version's learning rate
(learners/schedule.py) -> version += 1 -> hold first uses -> gather full weights and publish
them (rank 0) -> checkpoint when due, then ack what it holds as "trained".

Acks follow checkpoints. A group trained for the first time stays pending in the stream, held
(ExperienceQueue.hold, every step: its reclaim timer reset, no delivery counted), until a
checkpoint that holds its update is complete on every rank; then rank 0 acks it as trained.
The checkpoint lists these ids (acks_due), so a crash between the checkpoint and the ack does
not train them twice: resume acks those still pending. A crash before the checkpoint loses the
updates since the last one, never the groups: resume restarts from the checkpoint, and the held
groups, pending under this consumer's name, are delivered again at once and trained again. Why
train them again rather than ack them under a reason of their own: they are off-policy data
like any other (the behaviour weight corrects for the weights that made them), the generation
is not thrown away, and then `trained` in the stream counts exactly the groups the newest
checkpoint's weights were trained on (with learner.max_reuse 1). A group made by weights ahead
of a restarted learner (after such a rollback) is trained the same way, not rejected.
Without a checkpoint directory there is nothing to wait for: groups are acked at each step.
learner.algorithm dpo and rs take the same batches, acks and staleness, and train their own
rows with their own loss (learners/preference.py) in place of advantages and policy_loss.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from async_rlhf.config import LearnerConfig
from async_rlhf.messages import CompletionGroup, StepMetrics, StepTimes
from async_rlhf.procs import return_freed_memory
from async_rlhf.protocols import ExperienceQueue, ReplayBuffer, TrainBackend, WeightPublisher
from async_rlhf.types import Group, Received, TrajectoryError
from learners import advantages as adv_fns
from learners.batch import Batch, token_staleness
from learners.losses import NonFiniteError, aggregate, check_finite, kl_penalty, policy_loss, value_loss
from learners.preference import PreferenceObjective
from learners.samples import sample_stats
from learners.schedule import lr_at
from learners.shaping import Shaping

log = logging.getLogger(__name__)

_PPO_STATS = ("clip_frac", "ratio_mean", "bw_mean", "bw_capped_frac")  # token-weighted means


class Learner:
    """One data-parallel rank of the learner (see module docstring for the split).

    backend: this rank's TrainBackend (built with the generators' sampling temperature):
    learners.deepspeed_backend, or learners.torch_backend for one process.
    max_staleness: k; groups with version - policy_version (their oldest member's) > k are acked
    "dropped_stale". group_size: the generators' samples per prompt; cfg.batch_size must be a
    multiple of it, and a group of another size is rejected (dead-lettered as "group_size").
    queue, replay, publisher: rank 0 only (None elsewhere); the replay holds what it hands out
    to the same max_staleness (it evicts the rest); without a publisher no weights are gathered.
    ckpt_dir: where checkpoints go and where `resume()` looks. Every rank calls step()/train(),
    resume(), save_checkpoint() and publish_weights() together (they are collective).
    `counters` (count_* in the metrics): samples and tokens count samples; groups,
    dropped_stale, duplicate, rejected_<reason>, lost_to_reclaim and trained_first_use count
    groups.
    """

    def __init__(
        self,
        cfg: LearnerConfig,
        backend: TrainBackend,
        *,
        max_staleness: int,
        group_size: int,
        queue: ExperienceQueue | None = None,
        replay: ReplayBuffer | None = None,
        publisher: WeightPublisher | None = None,
        ckpt_dir: str | os.PathLike | None = None,
        response_limit: int = 0,
        completions: Callable[[Sequence[Received], int], tuple[CompletionGroup, ...]] | None = None,
    ):
        self.cfg, self.backend = cfg, backend
        self.rank, self.world = backend.rank, backend.world_size
        if self.rank == 0 and (queue is None or replay is None):
            raise ValueError("rank 0 consumes the stream: give it the queue and the replay buffer")
        if group_size <= 0 or cfg.batch_size % group_size:
            raise ValueError(f"learner.batch_size ({cfg.batch_size}) must be a multiple of the group "
                             f"size ({group_size}): a batch holds whole groups")
        self.max_staleness, self.group_size = max_staleness, group_size
        self.queue, self.replay, self.publisher = queue, replay, publisher
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir else None
        self.version = 0
        self._saved_version = -1  # the version of the newest checkpoint written or loaded
        self._unsaved: list[str] = []  # rank 0: entry ids trained since then, held (not acked)
        self._last_progress = time.monotonic()  # when data last arrived (learner.wait_s)
        self._giving_up = False  # the job is ending with an error: stop waiting for data
        self.counters: collections.Counter[str] = collections.Counter()
        # rank 0: (the batch's groups, the version they make) -> the completions to show, or ()
        self.completions = completions
        self.shaping = Shaping(cfg, response_limit)  # overlong, reward normalisation and clipping
        self._publish = publisher is not None
        if self.world > 1:  # every rank joins the ZeRO-3 gather iff rank 0 publishes
            flag = torch.tensor([int(self._publish)], device=backend.device)
            dist.broadcast(flag, 0)
            self._publish = bool(flag.item())
        self._vocab = backend.vocab_size
        # With one optimizer step per batch, pi_prox (the weights before this step) is what the
        # training forward computes: take it detached there (as TRL does for num_iterations=1)
        # rather than in a separate pass, a fifth of the step. A KL-in-reward needs it earlier.
        # (The models train without dropout: learners.models.disable_dropout.)
        self.prox_from_forward = (cfg.ratio_to == "prox" and cfg.minibatches == 1
                                  and not (cfg.kl_mode == "reward" and backend.has_reference))
        # learner.algorithm dpo or rs: its own rows and loss on the same batches (no pi_prox)
        self.objective = None if cfg.algorithm == "ppo" else PreferenceObjective(cfg, backend, group_size)
        self.prox_from_forward |= self.objective is not None

    # -- the loop --------------------------------------------------------------------------
    def train(self, steps: int | None = None) -> list[StepMetrics]:
        """Run `steps` (default: until cfg.steps versions), checkpointing as configured."""
        history = []
        target = self.cfg.steps if steps is None else self.version + steps
        while self.version < target:
            history.append(self.step())
        if self.ckpt_dir and history:
            self.save_checkpoint()  # the end of the run (a no-op if step() just saved it)
        return history

    def step(self) -> StepMetrics:
        """One policy version: wait, recompute, advantages, optimizer step(s), ack, publish,
        and a checkpoint every learner.checkpoint_every versions (when ckpt_dir is set)."""
        timing = collections.Counter()
        t = time.perf_counter()
        items, first_use = self._collect() if self.rank == 0 else ([], [])
        batch = Batch.from_received(items) if self.rank == 0 else None
        batch = Batch.broadcast(batch, self.backend.device) if self.world > 1 else batch.to(self.backend.device)
        timing["wait"] = time.perf_counter() - t

        cfg = self.cfg
        lr = lr_at(self.version, lr=cfg.lr, warmup=cfg.lr_warmup_steps, total=cfg.steps,
                   schedule=cfg.lr_schedule)
        self.backend.set_lr(lr)
        stats = self._train_batch(batch, timing)

        staleness = (self.version - batch.versions).tolist()
        group_sizes = torch.bincount(batch.groups.cpu())
        self.version += 1
        tokens = int(batch.mask.sum())
        self.counters.update(samples=len(staleness), groups=len(group_sizes), tokens=tokens, steps=1)
        if self.rank == 0:
            self.counters["trained_first_use"] += len(first_use)  # groups
            if self.ckpt_dir is None:
                self.queue.ack(first_use, reason="trained")
            else:  # acked by the checkpoint that holds their update (module docstring)
                self._unsaved = self.queue.hold(self._unsaved + first_use, self.version)

        self.publish_weights(timing)
        # the step's freed gradients, activations and temporaries stay in the heaps of the threads
        # that freed them, out of the next step's reach: 14.8 -> 11.8 GiB on a 0.5B model's rank
        return_freed_memory()
        every = self.cfg.checkpoint_every
        if self.ckpt_dir and every and self.version % every == 0:
            t = time.perf_counter()
            self.save_checkpoint()
            timing["checkpoint"] = time.perf_counter() - t

        fields = {f.name for f in dataclasses.fields(StepMetrics)}
        extra = {k: stats.pop(k) for k in list(stats) if k not in fields}  # kl, value_loss, pairs...
        return StepMetrics(
            version=self.version,
            **stats,
            lr=lr,
            samples=len(staleness),
            samples_fresh=len(first_use) * self.group_size,
            tokens=tokens,
            reward_mean=float(batch.rewards.mean()),
            groups=len(group_sizes),
            group_size_min=int(group_sizes.min()),
            groups_singleton=int((group_sizes == 1).sum()),
            staleness_max=max(staleness),
            staleness_mean=sum(staleness) / len(staleness),
            staleness_hist=dict(sorted(collections.Counter(staleness).items())),
            staleness_token_mean=token_staleness(items, self.version - 1),
            reward_by_version=batch.reward_by_version(),
            trained_by_generator=dict(collections.Counter(t.generator_id for r in items
                                                          for t in r.group.members)),
            times=StepTimes(**timing),
            counts=dict(self.counters),
            extra=extra,
            **(sample_stats(items) if self.rank == 0 else {}),
            completions=self.completions(items, self.version) if self.completions and self.rank == 0 else (),
        )

    def publish_weights(self, timing: collections.Counter | None = None) -> None:
        """Gather full weights (collective) and hand them to the publisher stamped with the
        current version. step() calls it; call it after resume() so generators catch up."""
        timing = collections.Counter() if timing is None else timing
        timing["weight_gather"] = timing["publish"] = 0.0
        if not self._publish:
            return
        # streamed: each weight goes straight into its bucket, with no whole copy of the model
        weights = _timed(self.backend.named_full_weights(), timing, "weight_gather")
        t = time.perf_counter()
        if self.rank == 0 and self.publisher is not None:
            self.publisher.publish(weights, self.version)
        else:
            collections.deque(weights, maxlen=0)  # the gather is collective: every rank goes to the end
        timing["publish"] = time.perf_counter() - t - timing["weight_gather"]

    # -- rank 0: the stream ----------------------------------------------------------------
    def _collect(self) -> tuple[list[Received], list[str]]:
        """Whole usable groups holding exactly batch_size samples (and the entry ids trained for
        the first time). Every group has group_size members (_admit rejects the others), so
        this is batch_size / group_size stream entries."""
        need = self.cfg.batch_size // self.group_size
        items: list[Received] = []
        first_use: list[str] = []
        self.keep_waiting()
        while len(items) < need:
            fresh = self._admit(self.queue.get(need, block_ms=200))
            self.replay.add(fresh)
            draw = self.replay.draw(need - len(items), self.version)
            for entry_id, reason in draw.dropped:
                self.queue.ack([entry_id], reason=reason)
                self.counters[reason] += 1
            items += draw.items  # within the staleness bound: the replay evicted the rest
            first_use += draw.first_use
            if fresh or draw.items:
                self.keep_waiting()
            elif self._giving_up:
                raise RuntimeError(f"the job is ending: the step at version {self.version} stops "
                                   f"waiting for data ({len(items)}/{need} collected)")
            elif time.monotonic() - self._last_progress > self.cfg.wait_s:
                raise TimeoutError(
                    f"no usable groups for {self.cfg.wait_s:.0f} s at version {self.version} "
                    f"({len(items)}/{need} collected): are the generators running and admitted? "
                    "(raise learner.wait_s for slow generation)"
                )
            if len(items) == need:
                items, first_use = self._renew(items, first_use)
        return items, first_use

    def keep_waiting(self) -> None:
        """Restart the learner.wait_s clock (data arrived, or the launcher knows why none can)."""
        self._last_progress = time.monotonic()

    def give_up_waiting(self) -> None:
        """The job ends with an error: a step waiting for data that may never come raises
        instead, so that the checkpoint need not wait learner.wait_s for it."""
        self._giving_up = True

    def _renew(self, items: list[Received], first_use: list[str]) -> tuple[list[Received], list[str]]:
        """Keep the first-use items this consumer still owns, their reclaim timers reset, so
        nobody else trains them before our ack (ExperienceQueue.renew: exactly-once training)."""
        if not first_use:
            return items, first_use
        owned = set(self.queue.renew(first_use))
        lost = set(first_use) - owned
        if lost:  # reclaimed by another consumer while we waited: theirs now
            self.counters["lost_to_reclaim"] += len(lost)
            items = [r for r in items if r.entry_id not in lost]
            first_use = [e for e in first_use if e in owned]
        return items, first_use

    def _admit(self, received: Sequence[Received]) -> list[Received]:
        """Keep the groups that are valid, fresh enough and no copy: ack the stale with a counted
        reason, move those this learner cannot train on to the dead-letter stream, bytes and
        reason kept, and ack as `duplicate` an entry whose group id an earlier entry carried
        (the stream remembers, so this holds across restarts). Whole groups either way
        (counters count groups)."""
        keep, rejected = [], []
        for r in received:
            try:
                self._check(r.group)
            except TrajectoryError as e:
                rejected.append((r, e))
                continue
            if self.version - r.group.policy_version > self.max_staleness:
                self._drop(r.entry_id, "dropped_stale")
                continue
            keep.append(r)
        if rejected:
            self.queue.reject(rejected)
            self.counters.update(f"rejected_{e.reason}" for _, e in rejected)
        copies = set(self.queue.duplicates(keep)) if keep else set()
        if copies:
            self.queue.ack(sorted(copies), reason="duplicate")
            self.counters["duplicate"] += len(copies)
            log.warning("%d entries copy a group an earlier entry carried: acked as duplicate, not "
                        "trained (a producer put them twice)", len(copies))
        return [r for r in keep if r.entry_id not in copies]

    def _check(self, group: Group) -> None:
        """Raise TrajectoryError if this learner cannot train on the group (any member)."""
        group.validate()
        if group.size != self.group_size:
            raise TrajectoryError("group_size", f"group {group.group_id!r} has {group.size} samples, the "
                                  f"learner expects {self.group_size} (generator.group_size): a producer "
                                  "that splits groups, or one run with another group_size")
        for t in group.members:  # (one made ahead of a restarted learner is trained: see the top)
            if len(t.prompt_ids) == 0:
                raise TrajectoryError("empty_prompt", "the learner needs at least one prompt token")
            top = int(max(t.prompt_ids.max(), t.response_ids.max()))
            if top >= self._vocab or min(t.prompt_ids.min(), t.response_ids.min()) < 0:
                raise TrajectoryError("token_id", f"token id {top} outside the model's vocabulary "
                                      f"[0, {self._vocab}): generator and learner use different models")

    def _drop(self, entry_id: str, reason: str) -> None:
        self.queue.ack([entry_id], reason=reason)
        self.counters[reason] += 1

    # -- every rank: the maths -------------------------------------------------------------
    def _rank_rows(self, batch: Batch) -> torch.Tensor:
        """Row indices this rank trains, minibatch after minibatch, each minibatch's longest rows
        first: its micro-batches then hold rows of like length, and trimmed (Batch.trimmed)
        they compute little padding. The order changes no sum the loss is made of."""
        per_mb = batch.input_ids.shape[0] // self.cfg.minibatches
        n = per_mb // self.world
        lengths = batch.attention_mask.sum(1).cpu()
        if self.cfg.algorithm == "dpo":  # whole groups stay together (a pair meets in a micro-batch),
            groups = batch.groups.cpu()  # ordered by their longest row
            lengths = torch.zeros(int(groups.max()) + 1, dtype=lengths.dtype).scatter_reduce(
                0, groups, lengths, "amax", include_self=False)[groups]
        rows = [torch.arange(m * per_mb + self.rank * n, m * per_mb + (self.rank + 1) * n)
                for m in range(self.cfg.minibatches)]
        return torch.cat([r[torch.argsort(lengths[r], descending=True, stable=True)] for r in rows])

    def _micro_batches(self, local: Batch):
        """(first row, micro-batch trimmed of the padding all its rows share) over `local`."""
        mb, n = self.cfg.micro_batch, local.input_ids.shape[0]
        for s in range(0, n, mb):
            yield s, local.rows(torch.arange(s, min(s + mb, n))).trimmed()

    def _recompute(self, local: Batch, timing) -> dict[str, torch.Tensor]:
        """pi_prox (unless prox_from_forward), reference log-probs and critic values [n, T] for
        this rank's rows."""
        t = time.perf_counter()
        be, out = self.backend, collections.defaultdict(list)
        with be.inference():
            for _, mb in self._micro_batches(local):
                args = (mb.input_ids, mb.attention_mask, mb.positions)
                if self.cfg.ratio_to == "behavior":  # plain PPO (ablation): anchored on behaviour
                    out["prox_logp"].append(mb.behavior_logp)
                elif not self.prox_from_forward:
                    out["prox_logp"].append(be.logprobs(*args)[0])
                if be.has_reference:
                    out["ref_logp"].append(be.logprobs(*args, reference=True)[0])
                if be.has_critic:
                    out["old_values"].append(be.values(*args))
        timing["recompute"] += time.perf_counter() - t
        T = local.mask.shape[1]  # trimmed micro-batches' columns padded back to the batch's
        res = {k: torch.cat([F.pad(x, (0, T - x.shape[1])) for x in v]) for k, v in out.items()}
        check_finite(**res)
        return res

    def _advantages(self, batch: Batch, rows: torch.Tensor, local: Batch, rec: dict) -> tuple:
        """Per-token advantages [n, T] for this rank's rows, and returns for the critic."""
        cfg = self.cfg
        if cfg.advantage in ("grpo", "rloo"):
            fn = adv_fns.grpo_advantages if cfg.advantage == "grpo" else adv_fns.rloo_advantages
            seq = fn(batch.rewards.cpu(), batch.groups.cpu()).to(local.mask.device)[rows]
            return seq[:, None] * local.mask, None
        kl = None
        if cfg.kl_mode == "reward" and "ref_logp" in rec:
            kl = kl_penalty(rec["prox_logp"], rec["ref_logp"], cfg.kl_estimator)
        r = adv_fns.token_rewards(local.rewards, local.mask, kl, cfg.kl_coef)
        if cfg.advantage == "reinforce_pp":
            adv, returns = adv_fns.discounted_returns(r, local.mask, cfg.gamma), None
        else:
            adv, returns = adv_fns.gae(r, rec["old_values"], local.mask, cfg.gamma, cfg.lam)
        moments = adv_fns.masked_moments(adv, local.mask)
        if self.world > 1:
            moments = moments.to(self.backend.device)
            dist.all_reduce(moments)
        return adv_fns.whiten(adv, local.mask, moments.cpu()), returns

    def _train_batch(self, batch: Batch, timing) -> dict:
        """`minibatches` optimizer steps on this rank's rows. A step where any rank's loss is not
        finite, or whose gradient norm is not, changes nothing and is counted (_count_skip)."""
        cfg, be = self.cfg, self.backend
        batch = self.shaping(batch) if self.shaping.active else batch  # the metrics keep the scored rewards
        B = batch.input_ids.shape[0]
        rows = self._rank_rows(batch).to(batch.mask.device)
        local = batch.rows(rows)
        rec = self._recompute(local, timing)
        if self.objective is None:  # targets: per-token advantages (policy_loss checks them)
            targets, returns = self._advantages(batch, rows, local, rec)
        else:  # ...or each row's role in dpo/rs (chosen, rejected, not trained)
            roles, counters = self.objective.roles(batch)
            self.counters.update(counters)
            targets, returns = roles[rows], None

        per_mb = B // cfg.minibatches
        n_local = per_mb // self.world
        sums = collections.Counter()
        grad_norms, skipped = [], 0
        bw_max = torch.zeros(1, device=be.device)
        for m in range(cfg.minibatches):
            mb_rows = slice(m * per_mb, (m + 1) * per_mb)
            # rows with a token to train (learner.overlong=mask may mask whole rows, as verl counts
            # them), and at least 1: it may have masked every row
            live = batch.mask[mb_rows]
            counts = (dict(num_tokens=max(float(live.sum()), 1.0), num_seqs=max(float(live.any(1).sum()), 1.0))
                      if self.objective is None else self.objective.counts(batch, roles, mb_rows))
            local_m = local.rows(torch.arange(m * n_local, (m + 1) * n_local))
            why_skip = ""  # set on every rank once any rank's loss in this optimizer step is not finite
            for s, mb in self._micro_batches(local_m):
                # this micro-batch's rows and (trimmed) response columns of the rank's tensors
                idx = (slice(m * n_local + s, m * n_local + s + mb.input_ids.shape[0]),
                       slice(0, mb.mask.shape[1]))
                mine = {k: v[idx] for k, v in rec.items()}
                t = time.perf_counter()
                target = targets[idx] if self.objective is None else targets[idx[0]]  # roles: [n]
                loss, parts, st, why = self._micro_loss(mb, mine, target, counts)
                timing["forward"] += time.perf_counter() - t
                why_skip = self._any_rank(why_skip or why)
                t = time.perf_counter()
                # a step to skip still runs backward on every rank (gradient reduction is
                # collective), of NaN: its gradient norm is NaN and the backend drops the update
                be.backward(loss * math.nan if why_skip else loss)
                timing["backward"] += time.perf_counter() - t
                t = time.perf_counter()
                norm = be.step()
                timing["step"] += time.perf_counter() - t
                if norm is not None and math.isfinite(norm):
                    grad_norms.append(norm)
                elif norm is not None:
                    skipped += 1
                    self._count_skip(batch, m, why_skip or f"gradient norm {norm}")
                if be.has_critic:
                    self._critic_micro_step(mb, mine["old_values"], returns[idx], counts, sums, timing)
                ntok = float(mb.mask.sum())
                # the positions the forward computed, and those that were a token (pad_share)
                sums.update(parts, tokens=ntok, positions=float(be.forward_positions(mb.attention_mask)),
                            token_positions=float(mb.attention_mask.sum()))
                if self.objective is not None:
                    sums.update(st)  # stat sums already
                else:
                    sums.update({k: st[k] * ntok for k in _PPO_STATS})
                    bw_max = torch.maximum(bw_max, torch.tensor([st["bw_max"]], device=be.device))
        return {**self._reduce_stats(sums, bw_max, grad_norms), "skipped_nonfinite": skipped}

    def _micro_loss(self, mb: Batch, rec: dict, targets: torch.Tensor,
                    counts: dict) -> tuple[torch.Tensor, dict, dict, str]:
        """Forward and loss of one micro-batch (`rec`: _recompute's tensors at its rows and
        columns): (this rank's share of the loss, its parts and the policy stats as floats, why
        the loss is not finite or ""). targets: the advantages [n, T], or in dpo/rs the rows'
        roles [n]. A NaN/inf input on a real token (NonFiniteError) gives a NaN loss that still
        reaches every parameter, and NaN stats."""
        cfg, be = self.cfg, self.backend
        if self.objective is not None:
            return self.objective.micro_loss(mb, targets, rec.get("ref_logp"), counts)
        logp, entropy = be.logprobs(mb.input_ids, mb.attention_mask, mb.positions,
                                    with_entropy=True, entropy_grad=cfg.entropy_coef > 0)
        prox = logp.detach() if self.prox_from_forward else rec["prox_logp"]
        why = ""
        try:
            pg, st = policy_loss(
                logp, prox, mb.behavior_logp, targets, mb.mask,
                clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high, correction=cfg.correction,
                is_cap=cfg.is_cap, level=cfg.correction_level, ratio_to=cfg.ratio_to, agg=cfg.loss_agg,
                **counts,
            )
        except NonFiniteError as e:
            pg, why = logp.sum() * math.nan, str(e)
            st = dict.fromkeys((*_PPO_STATS, "bw_max"), math.nan)
        ent = aggregate(entropy, mb.mask, cfg.loss_agg, **counts)
        loss = pg - cfg.entropy_coef * ent
        parts = {"loss_policy": pg.item(), "entropy": ent.item()}
        if "ref_logp" in rec:
            kl = aggregate(kl_penalty(logp, rec["ref_logp"], cfg.kl_estimator), mb.mask,
                           cfg.loss_agg, **counts)
            if cfg.kl_mode == "loss":
                loss = loss + cfg.kl_coef * kl
            parts["kl"] = kl.item()
        parts["loss"] = loss.item()
        return loss, parts, st, why or ("" if math.isfinite(parts["loss"]) else f"loss {parts['loss']}")

    def _any_rank(self, why: str) -> str:
        """`why`, or a stand-in when only another rank has a reason: every rank learns whether
        any rank must skip (collective: all ranks call it once per micro-batch)."""
        if self.world == 1:
            return why
        flag = torch.tensor([float(bool(why))], device=self.backend.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return why or ("a non-finite loss on another rank" if flag.item() else "")

    def _count_skip(self, batch: Batch, m: int, why: str) -> None:
        """Count and log an optimizer step that changed no weight. The batch is still acked as
        trained and the version still advances in step(), publishing the unchanged weights:
        generators and the staleness gate keep seeing one version per batch consumed, and
        retrying a batch whose numbers blew up would most likely blow up again."""
        self.counters["skipped_nonfinite"] += 1
        log.warning("rank %d: optimizer step %d/%d of learner version %d skipped, nothing changed: %s "
                    "(batch from policy versions %s)", self.rank, m + 1, self.cfg.minibatches,
                    self.version, why, sorted(set(batch.versions.tolist())))

    def _critic_micro_step(self, mb: Batch, old_values, returns, counts, sums, timing) -> None:
        be = self.backend
        t = time.perf_counter()
        values = be.values(mb.input_ids, mb.attention_mask, mb.positions)
        vloss, vst = value_loss(values, old_values, returns, mb.mask, clip=self.cfg.value_clip,
                                agg=self.cfg.loss_agg, **counts)
        timing["forward"] += time.perf_counter() - t
        t = time.perf_counter()
        be.backward(vloss, critic=True)
        timing["backward"] += time.perf_counter() - t
        t = time.perf_counter()
        be.step(critic=True)
        timing["step"] += time.perf_counter() - t
        sums.update(value_loss=vloss.item(), value_clip_frac=vst["value_clip_frac"] * float(mb.mask.sum()))

    def _reduce_stats(self, sums, bw_max, grad_norms) -> dict:
        """Sum loss parts over ranks (each is a share of the global loss); token-weight the rest."""
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.backend.device)
        if self.world > 1:
            dist.all_reduce(vec)
            dist.all_reduce(bw_max, op=dist.ReduceOp.MAX)
        total = dict(zip(keys, vec.tolist()))
        ntok = max(total.pop("tokens"), 1.0)
        out = {}
        if self.objective is not None:  # its own stats; PPO's have no meaning there
            out = {**self.objective.step_stats(total), **dict.fromkeys(_PPO_STATS, math.nan)}
        out["pad_share"] = 1.0 - total.pop("token_positions") / max(total.pop("positions"), 1.0)
        for k, v in total.items():
            if k in (*_PPO_STATS, "value_clip_frac"):
                out[k] = v / ntok
            else:  # loss parts: summed shares over micro-batches, averaged over optimizer steps
                out[k] = v / self.cfg.minibatches
        out["bw_max"] = float(bw_max) if self.objective is None else math.nan
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        return out

    # -- checkpoint ------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The backend's checkpoint + version + counters + the generators' prompt positions
        (collective); nothing to do if this version is saved already."""
        if self._saved_version == self.version:
            return
        positions = self.queue.prompt_positions() if self.queue is not None else {}
        state = {"policy_version": self.version, "counters": dict(self.counters),
                 "prompt_positions": positions, "reward_moments": self.shaping.moments.state_dict(),
                 "acks_due": list(self._unsaved)}
        self.backend.save_checkpoint(self.ckpt_dir, tag=f"v{self.version}", client_state=state)
        self._saved_version = self.version
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:  # complete on every rank: what it holds is trained for good
            self.queue.ack(self._unsaved, reason="trained")
            self._unsaved = []
            # keep the newest few: backends never delete a tag
            for root in (self.ckpt_dir, self.ckpt_dir / "critic"):
                tags = sorted((int(p.name[1:]), p) for p in root.glob("v*") if p.name[1:].isdigit())
                for _, old in tags[:-self.cfg.keep_checkpoints]:
                    shutil.rmtree(old, ignore_errors=True)

    def resume(self) -> bool:
        """Restore the latest checkpoint in ckpt_dir if there is one; True if restored. Either
        way the groups a previous incarnation held are to be trained again (module docstring)."""
        state = self.backend.load_checkpoint(self.ckpt_dir) if self.ckpt_dir else None
        if state is None:
            if self.queue is not None:
                self.queue.learner_restarted(self.version)
            return False
        self.version = self._saved_version = int(state["policy_version"])
        self.counters = collections.Counter(state["counters"])
        if "reward_moments" in state:
            self.shaping.moments.load_state_dict(state["reward_moments"])
        if self.queue is not None:  # the stream's own positions win where it has them
            self.queue.restore_prompt_positions(state.get("prompt_positions", {}))
            # trained into this checkpoint, maybe not acked yet (a crash just after it)
            self.queue.ack(self.queue.renew(state.get("acks_due", [])), reason="trained")
            self.queue.learner_restarted(self.version)
        return True


def _timed(items: Iterator, timing: collections.Counter, key: str) -> Iterator:
    """`items`, adding the seconds spent producing each to timing[key]."""
    while True:
        start = time.perf_counter()
        item = next(items, None)
        timing[key] += time.perf_counter() - start
        if item is None:
            return
        yield item
