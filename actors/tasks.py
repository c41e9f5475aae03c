"""Built-in tasks with verifiable rewards in [0, 1] that a random-init model can learn on CPU.

Each prompt's text starts with its task's name and `Prompt.answer` holds the reference, so the
default reward `actors.tasks:score` needs nothing but the prompt and the response text.

  count    easy. "count a: 482=" -> reward = min(number of 'a' in the response, 8) / 8 (the
           answer is "aaaaaaaa", so exact-match evaluation also works). Not
           prompt-conditioned: it only asks the policy to favour one token, so it rises within a
           few dozen learner steps (a random-init tiny model starts near 0.05 with 16 new tokens).
  echo     prompt-conditioned. "echo 3: 482=" -> reward = min(number of 3s in the response, 8) / 8:
           the count task with the digit (1-4) named in the prompt. A policy that ignores the
           prompt scores at most 0.5 on average, but the cap lets a prompt-blind response (8 of
           one digit, 8 of another) score 1 on half the prompts, a plateau `pick` does not have;
           its runs are noisy.
  pick     prompt-conditioned, for evaluation. "pick 4821 c" -> reward = the share of the
           response's characters that are the letter named last (a-d; the digits only vary the
           prompt); 0 for an empty response. No cap: only a response made of the named letter
           scores 1. Prompt-blind ceiling: a response's mean reward over prompts is
           sum_c P(c) share_c <= max_c P(c), reached by repeating the most frequent letter, so
           `prompt_blind_ceiling` is exact: 0.25 for the uniform letter (tested).
  copy     prompt-conditioned, hard. "copy 3142=" -> "3142": 0.8 x the fraction of the answer's digits
           found at their position + 0.2 if the response has the answer's length (1.0 iff equal);
           partial credit guides learning, which needs a few hundred steps.
  reverse  as copy, with the digits reversed ("reverse 3142=" -> "2413"); harder.
  calc     episodes with a tool (actors.envs:Calculator). "calc 3+5=" -> call the calculator,
           read its reply, answer "8".
  guess    a multi-turn game (actors.envs:GuessNumber). "guess 4821=" -> find a hidden number
           in 1..4 from higher/lower replies.
           These two are scored by their environments (env.target), not by `score`.
  length   response lengths that vary widely, for streaming generation. "length 37=" -> any
           response of 37 characters (tokens, with the character tokenizer) then EOS; reward =
           max(0, 1 - |length - 37| / 37). The ideal length is drawn from 4..64, so give it
           generator.max_new_tokens >= 65 (configs/bench-length.yaml). A random-init model
           rarely samples EOS, so it starts near the cap and learns where to stop.

Held-out split: a prompt text is held out iff a hash of it falls in one of HELDOUT_SHARE
buckets (`is_heldout`); `examples(..., split="train")` (what training draws) never yields one and
`split="heldout"` (what evaluation draws) yields only those, so the two are disjoint by
construction whatever the seeds and counts. A task with few distinct prompts (length has 61)
loses the held-out ones from training altogether.

Prompts with other first words (a JSONL data set, say) are scored by exact match with their
answer, stripped of surrounding spaces; a prompt with no answer cannot be scored and raises, which
the generator counts and sets aside.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from async_rlhf.types import Prompt

COUNT_TARGET = 8  # 'a's that earn the full count reward
LENGTH_RANGE = (4, 64)  # ideal response lengths of the length task
PICK_LETTERS = "abcd"  # what the pick task names
HELDOUT_SHARE = 8  # one prompt text in 8 is held out from training, for evaluation


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt text, answer)
    reward: Callable[[str, str], float]  # (response, answer) -> reward in [0, 1]
    env: str = ""  # the environment (env.target) that scores its episodes instead of `reward`


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(3, 5)))


def _count_reward(response: str, answer: str) -> float:
    return min(response.count("a"), COUNT_TARGET) / COUNT_TARGET


def _echo_reward(response: str, answer: str) -> float:
    return min(response.count(answer), COUNT_TARGET) / COUNT_TARGET


def _pick_reward(response: str, answer: str) -> float:
    return response.count(answer) / len(response) if response else 0.0


def positional_match(response: str, answer: str) -> float:
    """0.8 x the share of answer characters matched at their position + 0.2 for the right length
    (1.0 iff response == answer, after stripping spaces)."""
    response = response.strip()
    if not answer:
        return float(not response)
    matched = sum(a == b for a, b in zip(response, answer)) / len(answer)
    return 0.8 * matched + 0.2 * (len(response) == len(answer))


def _length_reward(response: str, answer: str) -> float:
    target = int(answer)
    return max(0.0, 1.0 - abs(len(response) - target) / target)


def _make_count(rng: random.Random) -> tuple[str, str]:
    return f"count a: {_digits(rng)}=", "a" * COUNT_TARGET


def _make_echo(rng: random.Random) -> tuple[str, str]:
    digit = rng.choice("1234")
    return f"echo {digit}: {_digits(rng)}=", digit


def _make_pick(rng: random.Random) -> tuple[str, str]:
    letter = rng.choice(PICK_LETTERS)
    return f"pick {_digits(rng)} {letter}", letter


def _make_copy(rng: random.Random) -> tuple[str, str]:
    digits = _digits(rng)
    return f"copy {digits}=", digits


def _make_reverse(rng: random.Random) -> tuple[str, str]:
    digits = _digits(rng)
    return f"reverse {digits}=", digits[::-1]


def _make_length(rng: random.Random) -> tuple[str, str]:
    target = str(rng.randint(LENGTH_RANGE[0], LENGTH_RANGE[1]))
    return f"length {target}=", target


def _make_calc(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"calc {a}+{b}=", str(a + b)


def _make_guess(rng: random.Random) -> tuple[str, str]:
    return f"guess {_digits(rng)}=", str(rng.randint(1, 4))


def _scored_by_env(response: str, answer: str) -> float:
    raise ValueError("this task's episodes are scored by its environment: set env.target "
                     "(actors.envs:Calculator for calc, actors.envs:GuessNumber for guess)")


TASKS: dict[str, Task] = {
    "count": Task("count", _make_count, _count_reward),
    "echo": Task("echo", _make_echo, _echo_reward),
    "pick": Task("pick", _make_pick, _pick_reward),
    "copy": Task("copy", _make_copy, positional_match),
    "reverse": Task("reverse", _make_reverse, positional_match),
    "length": Task("length", _make_length, _length_reward),
    "calc": Task("calc", _make_calc, _scored_by_env, env="actors.envs:Calculator"),
    "guess": Task("guess", _make_guess, _scored_by_env, env="actors.envs:GuessNumber"),
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: built-in tasks are {', '.join(TASKS)}")
    return TASKS[name]


def is_heldout(text: str) -> bool:
    """Whether a prompt text belongs to the held-out split (a hash bucket of its text)."""
    return zlib.crc32(text.encode()) % HELDOUT_SHARE == 0


def examples(task: str, seed: int, count: int,
             split: Literal["train", "heldout"] = "train") -> list[tuple[str, str]]:
    """`count` (prompt text, answer) pairs of `task` from `split`, the same for the same seed."""
    make = get_task(task).make
    rng = random.Random(f"{task}/{seed}" if split == "train" else f"{task}/{seed}/heldout")
    out: list[tuple[str, str]] = []
    for _ in range(100 * HELDOUT_SHARE * count):  # finite: a task may have few prompt texts
        text, answer = make(rng)
        if is_heldout(text) == (split == "heldout"):
            out.append((text, answer))
            if len(out) == count:
                return out
    raise ValueError(f"task {task!r} yielded {len(out)} of {count} {split} prompts: its prompt "
                     f"texts are too few to split; use fewer ({split}) or another task")


def prompt_blind_ceiling(pairs: Sequence[tuple[str, str]]) -> float:
    """The best mean reward a prompt-blind pick policy earns on `pairs`: the most frequent
    letter's share (see the module docstring: the optimum repeats one letter)."""
    return max(sum(_pick_reward(c, answer) for _, answer in pairs) for c in PICK_LETTERS) / len(pairs)


def score_one(prompt: Prompt, response: str) -> float:
    task = TASKS.get(prompt.query.split(" ", 1)[0])
    if task is not None:
        return task.reward(response, prompt.answer)
    if not prompt.answer:
        raise ValueError(
            f"prompt {prompt.prompt_id!r} is not a built-in task and has no answer to match: "
            "give it an answer (data.answer_key) or configure another reward"
        )
    return float(response.strip() == prompt.answer.strip())


def score(prompts: Sequence[Prompt], responses: Sequence[str]) -> list[float]:
    """The default reward (`actors.tasks:score`): one float in [0, 1] per response."""
    return [score_one(p, r) for p, r in zip(prompts, responses, strict=True)]
