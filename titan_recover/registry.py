"""Components registered by name, so that a TOML value picks one and a new one is a new module, not an edit."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named collection of components of one kind (``"quota policy"``, ``"fault kind"``...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(component: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._entries[name] = component
            return component

        return add

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"{self.kind} {name!r} is not registered; registered: {', '.join(self.names())}")
        return self._entries[name]
