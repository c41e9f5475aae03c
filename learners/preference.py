"""Preference and best-of-n objectives on the learner's batches (learner.algorithm dpo, rs).

The batch, its staleness, acks and accounting are the PPO path's (learners/learner.py): whole
groups, one stream entry each. What differs is which rows a step trains on and the loss:
    dpo  in each group the response with the highest reward is chosen and the one with the
         lowest rejected (the first such row on ties); a group whose rewards are all equal has
         no pair and is counted (groups_no_pair). Loss: losses.dpo_loss against the frozen
         reference (the initial policy) over sequence log-probs.
    rs   rejection sampling, best-of-n (RAFT, Dong et al. 2023): each group's best response is
         trained on with the token-mean negative log-likelihood, only where its reward is at
         least learner.rs_threshold (the others are counted: groups_below_threshold).
`roles` [B] marks every row of the global batch, the same on every rank: CHOSEN (dpo's chosen,
rs's best), REJECTED or 0 (not trained on). A micro-batch forwards only its rows with a role;
for dpo the learner keeps groups whole in its row order and dpo's config keeps a pair's two rows
in one micro-batch (micro_batch a multiple of group_size); pairs are matched by group.
"""

from __future__ import annotations

import math

import torch

from async_rlhf.config import LearnerConfig
from async_rlhf.protocols import TrainBackend
from learners.batch import Batch
from learners.losses import NonFiniteError, aggregate, dpo_loss, sequence_logprob

CHOSEN, REJECTED = 1, -1
PAIR_STATS = ("reward_margin", "chosen_logratio", "rejected_logratio", "pair_accuracy")


def _group_rows(groups: torch.Tensor):
    for g in groups.unique():
        yield (groups == g).nonzero().squeeze(1)


def preference_roles(rewards: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, int]:
    """roles [B] (int64) from rewards [B] and group indices [B]: per group its first row with the
    highest reward CHOSEN and its first with the lowest REJECTED; and the number of groups whose
    rewards are all equal (no pair, no role)."""
    roles, tied = torch.zeros_like(groups), 0
    for rows in _group_rows(groups):
        r = rewards[rows]
        if bool((r == r[0]).all()):
            tied += 1
            continue
        roles[rows[r.argmax()]], roles[rows[r.argmin()]] = CHOSEN, REJECTED
    return roles, tied


def best_of_group_roles(rewards: torch.Tensor, groups: torch.Tensor,
                        threshold: float) -> tuple[torch.Tensor, int]:
    """roles [B]: per group its first row with the highest reward CHOSEN if that reward is >=
    threshold; and the number of groups whose best is below it."""
    roles, below = torch.zeros_like(groups), 0
    for rows in _group_rows(groups):
        r = rewards[rows]
        if float(r.max()) >= threshold:
            roles[rows[r.argmax()]] = CHOSEN
        else:
            below += 1
    return roles, below


class PreferenceObjective:
    """The step's roles and the micro-batch loss of learner.algorithm dpo or rs."""

    def __init__(self, cfg: LearnerConfig, backend: TrainBackend, group_size: int):
        if cfg.algorithm not in ("dpo", "rs"):
            raise ValueError(f"PreferenceObjective trains dpo or rs, got learner.algorithm={cfg.algorithm!r}")
        if cfg.algorithm == "dpo" and (group_size < 2 or cfg.micro_batch % group_size):
            raise ValueError(f"learner.algorithm=dpo needs groups of >= 2 and learner.micro_batch "
                             f"({cfg.micro_batch}) a multiple of the group size ({group_size}): a "
                             "pair is two responses of one group, trained in one forward pass")
        if cfg.algorithm == "dpo" and not backend.has_reference:
            raise ValueError("learner.algorithm=dpo needs the frozen reference: build the backend "
                             "from the same LearnerConfig (learners.models.load_models loads it)")
        self.cfg, self.backend, self.dpo = cfg, backend, cfg.algorithm == "dpo"

    def roles(self, batch: Batch) -> tuple[torch.Tensor, dict[str, int]]:
        """roles [B] of the global batch, and the counters to add (groups without a pair, or
        whose best is below the threshold)."""
        rewards, groups = batch.rewards.cpu(), batch.groups.cpu()
        if self.dpo:
            roles, tied = preference_roles(rewards, groups)
            return roles.to(batch.mask.device), {"groups_no_pair": tied}
        roles, below = best_of_group_roles(rewards, groups, self.cfg.rs_threshold)
        return roles.to(batch.mask.device), {"groups_below_threshold": below}

    @staticmethod
    def counts(batch: Batch, roles: torch.Tensor, rows: slice) -> dict[str, float]:
        """Global normalisers of one optimizer step over batch rows `rows`: its pairs (dpo) and
        its trained response tokens (rs's loss, and the entropy)."""
        chosen = roles[rows] == CHOSEN
        return {"num_pairs": float(chosen.sum()),
                "num_tokens": float(batch.mask[rows][roles[rows] != 0].sum())}

    def micro_loss(self, mb: Batch, roles: torch.Tensor, ref_logp: torch.Tensor | None,
                   counts: dict[str, float]) -> tuple[torch.Tensor, dict, dict, str]:
        """As Learner._micro_loss: (this micro-batch's share of the loss, its parts, its stat
        sums, why the loss is not finite or ""), on the rows of mb with a role; roles [n] and
        ref_logp [n, T] are mb's rows'. The keys are the same on every call (ranks sum them).
        Without any role here the loss is zero and still reaches every parameter (backward is
        collective); a NaN/inf log-prob (NonFiniteError) gives a NaN loss and NaN stats."""
        idx = (roles != 0).nonzero().squeeze(1)
        train = mb.rows(idx if len(idx) else torch.arange(1, device=roles.device))
        logp, entropy = self.backend.logprobs(train.input_ids, train.attention_mask, train.positions,
                                              with_entropy=True)
        sums = dict.fromkeys(("pairs", *PAIR_STATS) if self.dpo else ("best_trained",), 0.0)
        if not len(idx):
            return logp.sum() * 0.0, {"loss_policy": 0.0, "entropy": 0.0, "loss": 0.0}, sums, ""
        ent = aggregate(entropy, train.mask, "token_mean", num_tokens=counts["num_tokens"])
        why = ""
        if self.dpo:
            try:
                loss, sums = self._dpo(logp, train, roles[idx], ref_logp[idx], counts["num_pairs"])
            except NonFiniteError as e:
                loss, why, sums = logp.sum() * math.nan, str(e), dict.fromkeys(sums, math.nan)
        else:
            loss = aggregate(-logp, train.mask, "token_mean", num_tokens=counts["num_tokens"])
            sums = {"best_trained": float(len(idx))}
        parts = {"loss_policy": loss.item(), "entropy": ent.item(), "loss": loss.item()}
        return loss, parts, sums, why or ("" if math.isfinite(parts["loss"]) else f"loss {parts['loss']}")

    def _dpo(self, logp, train: Batch, roles, ref_logp, num_pairs) -> tuple[torch.Tensor, dict]:
        norm = self.cfg.dpo_length_norm
        seq = sequence_logprob(logp, train.mask, length_norm=norm)
        ref = sequence_logprob(ref_logp, train.mask, length_norm=norm)
        c, r = (roles == CHOSEN).nonzero().squeeze(1), (roles == REJECTED).nonzero().squeeze(1)
        c, r = c[train.groups[c].argsort()], r[train.groups[r].argsort()]  # the i-th pair: a group's
        if not torch.equal(train.groups[c], train.groups[r]):
            raise ValueError(f"a micro-batch holds groups {train.groups[c].tolist()} chosen and "
                             f"{train.groups[r].tolist()} rejected: a pair's two rows must meet in one "
                             "micro-batch (learner.micro_batch a multiple of generator.group_size)")
        loss, st = dpo_loss(seq[c], seq[r], ref[c], ref[r], beta=self.cfg.dpo_beta,
                            loss_type=self.cfg.dpo_loss, num_pairs=num_pairs)
        pairs = float(len(c))
        return loss, {"pairs": pairs, **{k: st[k] * pairs for k in PAIR_STATS}}

    def step_stats(self, total: dict[str, float]) -> dict[str, float]:
        """The step's stats from the stat sums of every micro-batch and rank (popped from total):
        per-pair means and pairs (dpo), best responses trained (rs)."""
        if not self.dpo:
            return {"best_trained": total.pop("best_trained", 0.0)}
        pairs = total.pop("pairs", 0.0)
        means = {k: total.pop(k, 0.0) / pairs if pairs else float("nan") for k in PAIR_STATS}
        return {"pairs": pairs, **means}
