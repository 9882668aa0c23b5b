"""Registries of small classes, one per method: group sources, rollout backends, advantage transforms, add-on
learners. A class joins with the `register(name)` decorator (its `name` is set to it) and is looked up by the
config value that names it; an unknown name is an error naming the config key and the choices."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from sparserl.errors import UserError

T = TypeVar("T", bound=type)


class UnknownName(UserError):
    """A config value names no registered class."""


class Registry(dict[str, T], Generic[T]):
    """name -> class, in registration order; `key` is the config key that selects from it (for errors)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make the class available under `name`."""

        def add(cls: T) -> T:
            self[name] = cls
            cls.name = name
            return cls

        return add

    def described(self) -> str:
        """ "'name' (summary), ...": each entry with its docstring's first clause, for help strings that list
        what is registered instead of a hand-written list."""
        return ", ".join(
            f"'{name}' ({summary(cls)})" if summary(cls) else f"'{name}'" for name, cls in self.items()
        )

    def lookup(self, name: str) -> T:
        if name not in self:
            raise UnknownName(f"{self.key}={name!r} is unknown; choose one of {', '.join(self)}")
        return self[name]


def summary(obj: object) -> str:
    """The first clause of `obj`'s docstring: up to its first colon or full stop ('' without one)."""
    doc = " ".join((obj.__doc__ or "").split())
    for stop in (": ", ". "):
        doc = doc.split(stop)[0]
    doc = doc.rstrip(".")
    return doc[:1].lower() + doc[1:]
