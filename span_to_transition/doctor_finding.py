"""One finding of ``tracerl doctor``: what was seen, what it means, the exact fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    problem: str
    saw: str
    means: str
    fix: str

    def text(self) -> str:
        return f"problem: {self.problem}\n  saw:   {self.saw}\n  means: {self.means}\n  fix:   {self.fix}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
