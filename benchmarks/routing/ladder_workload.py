"""The QPS ladder's workload: groups sharing a long system prompt, several users each, multi-turn.

Shaped like llm-d's ``73-capacity`` benchmark: ``groups`` groups each share a system prompt of
``system`` tokens, and each group always has ``users`` users in conversation. A user asks
``turns`` questions of ``question`` tokens; every answer (``answer`` tokens) joins the history,
so turn k's prompt is the system prompt, the earlier questions and answers, and the new question.
When a user has asked all their questions a new user of the same group takes the seat, so the
mix stays the same however long the ladder runs: a request is the next turn of a seat drawn at
random, from a seeded generator, and every scorer gets the same sequence.

Prompt words are decimal numbers (the engine simulator takes a word of digits as that token id,
one token a word). An answer is what the simulator generates for it (``tok0 tok1 ...``), known in
advance, so a turn can carry the answer before it; it is the same text the engine stored as
blocks when it generated it, and the next turn hits them where they are still cached.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from llmgw.sim.sim_tokens import expected_text

VOCAB = 900_000_000  # nine-digit words: below the simulator's ten-digit cut, so each is its own id


@dataclass(frozen=True)
class Shape:
    groups: int
    users: int
    turns: int
    system: int
    question: int
    answer: int

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of turn ``turn``'s prompt (0-based): system, earlier questions and answers, the question."""
        return self.system + (turn + 1) * self.question + turn * self.answer


class Conversations:
    """An endless, seeded stream of prompts: each the next turn of a randomly drawn seat."""

    def __init__(self, shape: Shape, seed: int) -> None:
        self.shape = shape
        self._rng = random.Random(seed)
        self._systems = [self._words(shape.system) for _ in range(shape.groups)]
        self._answer = expected_text(shape.answer)
        self._seats: list[list[str]] = [[] for _ in range(shape.groups * shape.users)]  # each seat's turns so far

    def _words(self, n: int) -> str:
        r = self._rng.randrange
        return " ".join(str(r(1, VOCAB)) for _ in range(n))

    def next(self) -> tuple[int, int, str]:
        """(group, turn, prompt) of the next request."""
        s = self.shape
        seat = self._rng.randrange(len(self._seats))
        group = seat // s.users
        history = self._seats[seat]
        if len(history) == s.turns:  # the user is done: a new one sits down
            history.clear()
        history.append(self._words(s.question))
        parts = [self._systems[group]]
        for i, q in enumerate(history):
            parts.append(q)
            if i < len(history) - 1:
                parts.append(self._answer)
        return group, len(history) - 1, " ".join(parts)

    def take(self, n: int) -> list[tuple[int, int, str]]:
        return [self.next() for _ in range(n)]
