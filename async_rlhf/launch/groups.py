"""Ray placement groups: each part's resources reserved whole before its processes start, and
kept for its restarts.

- The learner: one group of `learner.ranks` bundles, a rank each ({"CPU": threads}, and one
  GPU on GPU). All ranks or none: a cluster that cannot hold them all ends the job at start,
  naming what was asked for and what the nodes have free, where ranks started one by one would
  wait for the others. On GPU the bundles PACK (as few nodes as hold them: NCCL's fast links
  are within a node); on CPU they SPREAD (where there are several nodes, each rank gets a node's
  cores and memory bandwidth of its own; gradients are small next to that). A learner restart
  puts the new ranks in the same bundles.
- Each generator: a group of one bundle (its threads, its engine's GPUs, its `resources`). A
  generator that died is replaced in its own bundle, which add-generators cannot take meanwhile;
  the group is removed when the generator is given up.
"""

from __future__ import annotations

from typing import Any

LEARNER_WAIT_S = 120.0  # for the learner's resources: an autoscaling cluster may add a node


def reserve(ray, bundles: list[dict[str, float]], strategy: str, name: str, *, wait_s: float | None = None):
    """A placement group of `bundles` (Ray resource dicts). With `wait_s`, wait that long for
    Ray to reserve it, then raise a ValueError naming the bundles and the free resources."""
    from ray.util.placement_group import placement_group

    group = placement_group(bundles, strategy=strategy, name=name)
    if wait_s is not None and not group.wait(wait_s):
        release(group)
        free = [{k: v for k, v in n["Resources"].items() if "memory" not in k and not k.startswith("node:")}
                for n in ray.nodes() if n["Alive"]]
        raise ValueError(f"the cluster has no room for {name}: {len(bundles)} x {bundles[0]} ({strategy}) "
                         f"not reserved in {wait_s:.0f} s; its nodes have {free} in all: add a node, or "
                         "ask for fewer (learner.ranks, learner.threads)")
    return group


def release(group) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(group)


def in_bundle(group, index: int = 0) -> dict[str, Any]:
    """Actor options that place it in bundle `index` of `group`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=index)}
