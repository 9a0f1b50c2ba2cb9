"""The package's version is the crate's: read from ../Cargo.toml when the wheel is built,
so the two cannot differ (pyproject.toml declares the version dynamic)."""

import os
import re

from setuptools import setup

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "Cargo.toml")) as f:
    version = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)

setup(version=version)
