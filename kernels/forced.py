"""A kernel family's forced choice between its implementations (by default its Pallas kernel
and its pure-jnp reference), for benchmarks that compare them inside a whole decoder and for
callers that know better than the default: `with implementation("ref"): ...` while tracing;
the dispatch asks `implementation.choice(default)`."""

from __future__ import annotations

import contextlib

CHOICES = ("pallas", "ref")


class Forced:
    def __init__(self, kernel: str, choices: tuple[str, ...] = CHOICES):
        self.kernel = kernel
        self.choices = choices
        self._stack: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        """Force `name` (one of `choices`) while tracing inside the block."""
        if name not in self.choices:
            raise ValueError(f"{self.kernel} implementation must be one of {self.choices}, "
                             f"got {name!r}")
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def choice(self, default: str) -> str:
        return self._stack[-1] if self._stack else default
