"""A name → object registry in the style of fvcore's: duplicates and unknown names are errors that
say which."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """``names``: each registered class takes its registered name as its ``name``, written once."""

    def __init__(self, kind: str, names: bool = False) -> None:
        self.kind, self.names_classes = kind, names
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in self._items:
                raise KeyError(
                    f"{self.kind} {name!r} is already registered (by {self._items[name]!r})"
                )
            self._items[name] = obj
            if self.names_classes:
                obj.name = name  # type: ignore[attr-defined]
            return obj

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(
                f"unknown {self.kind} {name!r}{did_you_mean(name, self._items)}; known: "
                f"{', '.join(sorted(self._items))}"
            )
        return self._items[name]

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> list[str]:
        return sorted(self._items)

    def registered(self) -> list[str]:
        """The names in the order they were registered."""
        return list(self._items)


# The objects bench.entry.predict_step was given in this process (a notebook's model or optimizer,
# which no import path reaches), by the "python:NAME" a suite it writes names each by; given
# again, the newest
GIVEN: dict[str, Any] = {}
GIVEN_PREFIX = "python:"


def import_object(path: str, kind: str) -> Any:
    """``"package.module:attr"`` imported, or ``"python:NAME"`` given to predict_step; a KeyError
    that says what failed, like an unknown name."""
    if path.startswith(GIVEN_PREFIX) and path in GIVEN:
        return GIVEN[path]
    module_name, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # noqa: BLE001  a user's module may fail in any way while it loads
        raise KeyError(f"cannot import {kind} {path!r}: {type(exc).__name__}: {exc}") from exc


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """ " (did you mean 'checkpoint'?)" for a typo close to a known name, else nothing."""
    close = difflib.get_close_matches(name, list(known), n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return ""
