"""A checkpoint directory's `latest` file: the tag (v<version>) of the checkpoint a run resumes
from. Both backends write it only once the whole checkpoint is on disk; the launcher reads it,
without torch."""

from __future__ import annotations

import os
from pathlib import Path


def mark_latest(ckpt_dir: str | os.PathLike, tag: str) -> None:
    """Name `tag` the checkpoint to resume from: ckpt_dir/latest, written whole, then renamed
    into place. Call it once the whole checkpoint is on disk."""
    latest = Path(ckpt_dir) / "latest"
    latest.with_suffix(".tmp").write_text(tag)
    os.replace(latest.with_suffix(".tmp"), latest)


def checkpoint_version(ckpt_dir: str | os.PathLike) -> int:
    """The policy version of the newest checkpoint in ckpt_dir (see Learner.save_checkpoint),
    0 if there is none."""
    latest = Path(ckpt_dir) / "latest"
    return int(latest.read_text().strip().removeprefix("v")) if latest.is_file() else 0
