"""Builds the package with the crate's cdylib inside (setuptools-rust, binding NoBinding:
the library goes in as is, and kvxfer._native binds its C ABI with ctypes).

- The crate: ../Cargo.toml in a checkout; in the sdist, rust/, the crate as `cargo package`
  makes it (what crates.io would get), which the sdist command below puts there.
- The version is the crate's, read from its Cargo.toml, so the two cannot differ
  (pyproject.toml declares the version dynamic).
- The wheel is tagged py3-none-<platform>: no CPython extension is inside, so one wheel
  serves every Python 3 that requires-python admits. The platform tag is the build host's
  (linux_x86_64); `make wheel` has auditwheel check the library's dependencies and symbol
  versions and give it the manylinux tag they allow (docs/python.md#wheels).
"""

import os
import re
import shutil
import subprocess
import tarfile
import tempfile

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.sdist import sdist
from setuptools_rust import Binding, RustExtension, Strip, build_rust

HERE = os.path.dirname(os.path.abspath(__file__))
CRATE = "rust" if os.path.isfile(os.path.join(HERE, "rust", "Cargo.toml")) else ".."

with open(os.path.join(HERE, CRATE, "Cargo.toml")) as f:
    VERSION = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


class Py3Wheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class PlainLibraryName(build_rust):
    """Installs the cdylib as kvxfer/libkvxfer.so: it is no CPython extension, so it takes
    no interpreter's suffix (libkvxfer.cpython-311-x86_64-linux-gnu.so)."""

    def get_dylib_ext_path(self, ext, target_fname):
        return os.path.join(os.path.dirname(super().get_dylib_ext_path(ext, target_fname)), "libkvxfer.so")


class SdistWithCrate(sdist):
    """Adds the crate under rust/, unpacked from the .crate `cargo package` writes: its
    sources and a manifest without the repository's test and example targets, so the
    sdist builds with cargo alone."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        if CRATE == "rust":
            shutil.copytree(os.path.join(HERE, "rust"), os.path.join(base_dir, "rust"))
            return
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                ["cargo", "package", "-q", "--no-verify", "--allow-dirty", "--target-dir", tmp],
                cwd=os.path.join(HERE, ".."),
                check=True,
            )
            with tarfile.open(os.path.join(tmp, "package", f"kvxfer-{VERSION}.crate")) as crate:
                # The "data" filter where this Python has it (3.12, and later patch releases
                # of 3.9 to 3.11); cargo wrote this archive, so it is trusted either way.
                crate.extractall(tmp, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
            shutil.copytree(os.path.join(tmp, f"kvxfer-{VERSION}"), os.path.join(base_dir, "rust"))


setup(
    version=VERSION,
    # The cdylib lands in the package as kvxfer/libkvxfer.so; kvxfer._native finds it.
    rust_extensions=[
        RustExtension(
            "kvxfer.libkvxfer",
            path=os.path.join(CRATE, "Cargo.toml"),
            binding=Binding.NoBinding,
            strip=Strip.Debug,
            # The versions of Cargo.lock, which the crate and the sdist carry.
            cargo_manifest_args=["--locked"],
        )
    ],
    cmdclass={"bdist_wheel": Py3Wheel, "build_rust": PlainLibraryName, "sdist": SdistWithCrate},
)
