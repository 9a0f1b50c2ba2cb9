"""Fixtures shared by the package's suite."""

import importlib.metadata

import pytest


@pytest.fixture
def installed(monkeypatch):
    """`installed(package, version)`: `importlib.metadata` reports `package` at `version`
    (None: not installed) for the rest of the test, every other distribution as it is; a
    runtime plug-in's version check reads the runtime's version from there."""
    real = importlib.metadata.version
    stand_ins = {}

    def version(name):
        if name not in stand_ins:
            return real(name)
        if stand_ins[name] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return stand_ins[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    return stand_ins.__setitem__
