"""A kernel family's forced choice between its Pallas kernel and its pure-jnp reference, for
benchmarks that compare the two inside a whole decoder: `with implementation("ref"): ...`
while tracing; the dispatch asks `implementation.choice(default)`."""

from __future__ import annotations

import contextlib

CHOICES = ("pallas", "ref")


class Forced:
    def __init__(self, kernel: str):
        self.kernel = kernel
        self._stack: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        """Force `name` ("pallas" or "ref") while tracing inside the block."""
        if name not in CHOICES:
            raise ValueError(f"{self.kernel} implementation must be 'pallas' or 'ref', got "
                             f"{name!r}")
        self._stack.append(name)
        try:
            yield
        finally:
            self._stack.pop()

    def choice(self, default: str) -> str:
        return self._stack[-1] if self._stack else default
