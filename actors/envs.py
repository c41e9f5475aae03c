"""Built-in environments for multi-turn episodes (actors/episodes.py), each the environment of a
built-in task's prompts (actors/tasks.py: calc, guess) that a random-init model learns on CPU,
and an agent (actors/agents.py) for the calc task that calls the model through the OpenAI client.

An environment is a class named `module:Class` in env.target, built once per episode with
env.args; `latency_s` (both here) makes every step wait that long, as a remote tool would,
for the benchmark. The interface, either method plain or async:

    reset(prompt: Prompt) -> str                       the first observation ("" for none)
    step(response: str) -> (observation, done, reward) the reply to one model turn; reward is a
                                                       float, or None to have the configured
                                                       rewards score the whole transcript

Calculator (task calc, "calc 3+5="): a tool-calling task. A turn holding `?` calls the
calculator, which evaluates the expression written before the `?` (`3+5?`) or, with none, the
question's, and replies `=8 `; any other turn is the answer, which ends the episode. Reward:
tool_bonus if the calculator was called before the answer, plus (1 - tool_bonus) x
`positional_match` of the answer's first number with the result (actors/tasks.py). The model
learns first to call (one token), then to copy the result it reads into its answer.

GuessNumber (task guess, "guess 4821=" with a hidden number in 1..4): a multi-turn game. Each
turn's first digit is a guess; the reply is `higher `, `lower ` or, for a turn without a
digit, `digit? `. A right guess ends the episode with reward 1 - 0.25 x (turns before it),
never below 0.25; otherwise the reward is 0. Guessing at random scores about 0.4; using the
replies, up to 1.

calculator_agent (env.agent, task calc, a model with a chat template): an agent as users write
them. It asks the model the question; the model's reply is a calculator call (`3+5?`: the
expression before the `?`, or the question's where it wrote none); the agent adds the
calculator's answer (`=8`) as a tool message and asks again; the reward is `positional_match`
of the second answer's first number with the question's result. The model learns to copy the
number it reads into its answer.
"""

from __future__ import annotations

import asyncio
import re

from async_rlhf.types import Prompt

from actors.tasks import positional_match

_EXPRESSION = re.compile(r"(\d+)([+-])(\d+)")


def evaluate(expression: str) -> int | None:
    """a+b or a-b of non-negative integers; None for anything else."""
    match = _EXPRESSION.fullmatch(expression.strip())
    if match is None:
        return None
    a, op, b = match.groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


class Calculator:
    def __init__(self, tool_bonus: float = 0.5, latency_s: float = 0.0):
        self.tool_bonus, self.latency_s = tool_bonus, latency_s
        self.called = False

    async def reset(self, prompt: Prompt) -> str:
        self.question = prompt.text.removeprefix("calc ").removesuffix("=")
        self.result = evaluate(self.question)
        return ""

    async def step(self, response: str) -> tuple[str, bool, float | None]:
        await asyncio.sleep(self.latency_s)
        if "?" in response:
            self.called = True
            written = evaluate(response.split("?")[0].split(" ")[-1])
            return f"={self.result if written is None else written} ", False, 0.0
        answer = re.search(r"-?\d+", response)
        match = positional_match(answer.group() if answer else "", str(self.result))
        return "", True, self.tool_bonus * self.called + (1 - self.tool_bonus) * match


class GuessNumber:
    def __init__(self, latency_s: float = 0.0):
        self.latency_s = latency_s
        self.turns = 0

    async def reset(self, prompt: Prompt) -> str:
        self.secret = int(prompt.answer)
        return ""

    async def step(self, response: str) -> tuple[str, bool, float | None]:
        await asyncio.sleep(self.latency_s)
        self.turns += 1
        digit = re.search(r"\d", response)
        if digit is None:
            return "digit? ", False, 0.0
        guess = int(digit.group())
        if guess == self.secret:
            return "", True, max(0.25, 1.0 - 0.25 * (self.turns - 1))
        return ("higher " if guess < self.secret else "lower "), False, 0.0


async def calculator_agent(client, prompt: Prompt) -> float:
    """Two chat calls per episode with a calculator between them (see the module doc)."""
    question = prompt.text.removeprefix("calc ").removesuffix("=")
    messages = [{"role": "user", "content": prompt.text}]
    call = await client.chat.completions.create(model="policy", messages=messages)
    asked = call.choices[0].message.content
    written = evaluate(asked.split("?")[0].split(" ")[-1])
    messages += [{"role": "assistant", "content": asked},
                 {"role": "tool", "content": f"={evaluate(question) if written is None else written}"}]
    reply = await client.chat.completions.create(model="policy", messages=messages)
    answer = re.search(r"-?\d+", reply.choices[0].message.content)
    return positional_match(answer.group() if answer else "", str(evaluate(question)))


async def refine_agent(client, prompt: Prompt) -> None:
    """Asks, then asks the model to improve on its answer; the configured rewards score the
    second answer (None). The pattern of self-refining agents, on any task."""
    messages = [{"role": "user", "content": prompt.text}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Improve your answer."}]
    await client.chat.completions.create(model="policy", messages=messages)
    return None
