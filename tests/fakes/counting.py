"""Counting the calls of a function or method in a test (the call still happens)."""

from __future__ import annotations

import inspect

import pytest


def counting(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (still calling it) in ``[0]`` of the list
    returned; a static method stays static."""
    calls = [0]
    real = getattr(owner, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return real(*args, **kwargs)

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(counted) if static else counted)
    return calls
