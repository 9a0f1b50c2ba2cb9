#!/usr/bin/env python3
"""Checks the wheel `make wheel` built, as PyPI and pip will see it: `make wheel-test` runs
this on target/wheels. Each check says what is wrong; all of them run, then it fails if any
did.

- Its tags: py3-none-manylinux_X_Y_<arch>, so one wheel serves every Python 3 and PyPI
  takes it (it refuses linux_x86_64).
- The manylinux tag is true of the library inside: it needs only the system libraries
  manylinux allows (CUDA and NIXL are loaded at run time with dlopen, never linked), no
  glibc symbol newer than X.Y, and it is built for <arch>.
- pip accepts it for every supported Python, offline: the versions of its Python
  classifiers, the oldest of which must be requires-python's lower bound; and pip refuses
  it for the Python below that bound.
- It installs into a fresh venv of each Python found here (python3.9 ... on PATH, or those
  given with --python), and examples/python/*.py run there on the installed package, with
  the library it carries. NumPy, which the examples use, comes from --deps (downloaded
  there once, if pip can reach an index).

  python3 python/tools/check_wheels.py target/wheels [--python python3.12 ...]
"""
import argparse
import email.parser
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = [os.path.join(ROOT, "examples", "python", name) for name in ("transfer.py", "store.py")]
# The libraries a manylinux wheel may link without carrying them (PEP 600's policy, as
# auditwheel applies it), of those a Rust cdylib can need.
MANYLINUX_LIBS = {
    "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libgcc_s.so.1",
    "libstdc++.so.6", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1",
}
# readelf -h's machine for each manylinux architecture.
MACHINES = {"x86_64": "Advanced Micro Devices X86-64", "aarch64": "AArch64"}
TAG = re.compile(r"^(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$")
MANYLINUX = re.compile(r"^manylinux_(?P<major>\d+)_(?P<minor>\d+)_(?P<arch>\w+)$")


class Checks:
    def __init__(self):
        self.failed = []

    def check(self, ok, what):
        print(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            self.failed.append(what)
        return ok


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def failure(r):
    """pip's last line where it failed, to follow a check's description."""
    return "" if r.returncode == 0 else ": " + (r.stdout.strip().splitlines() or ["(no output)"])[-1]


def the_wheel(folder):
    wheels = glob.glob(os.path.join(folder, "*.whl"))
    if len(wheels) != 1:
        sys.exit(f"check_wheels: {folder} holds {len(wheels)} wheels, not one; run `make wheel`")
    return wheels[0]


def check_tags(c, wheel):
    """The manylinux (major, minor, arch) of the wheel's name, or None."""
    name = os.path.basename(wheel)
    # name-version-tags.whl; neither name nor version has a dash in a wheel's file name.
    m = TAG.match(name.split("-", 2)[2])
    c.check(m and m["python"] == "py3" and m["abi"] == "none",
            f"{name}: python and abi tags are py3-none (the package has no CPython extension)")
    p = MANYLINUX.match(m["platform"]) if m else None
    c.check(p is not None, f"{name}: the platform tag is manylinux_X_Y_<arch>, which PyPI takes")
    return (int(p["major"]), int(p["minor"]), p["arch"]) if p else None


def check_library(c, wheel, manylinux, tmp):
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if re.fullmatch(r"kvxfer/libkvxfer[^/]*\.so[.0-9]*", n)]
        if not c.check(len(names) == 1, f"the wheel carries one libkvxfer.so: {names}"):
            return
        lib = z.extract(names[0], tmp)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", run(["readelf", "-d", lib]).stdout)
    extra = sorted(set(needed) - MANYLINUX_LIBS)
    c.check(needed and not extra,
            f"libkvxfer.so links only libraries manylinux allows: needs {needed}"
            + (f"; not allowed: {extra} (load them at run time with dlopen, as CUDA and NIXL are)" if extra else ""))
    if manylinux is None:
        return
    major, minor, arch = manylinux
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"\bGLIBC_([0-9.]+)", run(["objdump", "-T", lib]).stdout)}
    newest = max(versions, default=(0, 0))
    c.check(bool(versions) and newest <= (major, minor),
            f"libkvxfer.so needs glibc {'.'.join(map(str, newest))} at most, which manylinux_{major}_{minor} allows")
    machine = re.search(r"Machine:\s+(.*)", run(["readelf", "-h", lib]).stdout)
    c.check(machine is not None and machine[1].strip() == MACHINES.get(arch),
            f"libkvxfer.so is built for {arch}: {machine[1].strip() if machine else 'no ELF header'}")


def minor(version):
    return int(version.split(".")[1])


def supported_pythons(c, wheel):
    """The supported versions, python/pyproject.toml's Python classifiers, and the one
    below them; the wheel's metadata must state the same."""
    with open(os.path.join(ROOT, "python", "pyproject.toml")) as f:
        project = f.read()
    versions = sorted(re.findall(r'"Programming Language :: Python :: (3\.\d+)"', project), key=minor)
    bound = re.search(r'^requires-python = "(.*)"', project, re.M)
    c.check(bool(versions) and bound is not None and bound[1] == f">={versions[0]}",
            f"pyproject.toml: the oldest Python classifier ({versions[:1]}) is requires-python's bound ({bound and bound[1]})")
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
    classifier = re.compile(r"Programming Language :: Python :: (3\.\d+)$")
    stated = sorted((m[1] for m in map(classifier.match, meta.get_all("Classifier") or []) if m), key=minor)
    c.check(stated == versions and meta.get("Requires-Python") == (bound and bound[1]),
            f"the wheel states the same: Requires-Python {meta.get('Requires-Python')}, Pythons {stated}")
    return versions, (f"3.{minor(versions[0]) - 1}" if versions else None)


def pip_accepts(wheel, version, tmp):
    target = tempfile.mkdtemp(dir=tmp)
    return run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--only-binary", ":all:",
                "--python-version", version, "--target", target, wheel])


def check_pip(c, wheel, versions, below, tmp):
    for v in versions:
        r = pip_accepts(wheel, v, tmp)
        c.check(r.returncode == 0, f"pip takes the wheel for Python {v}" + failure(r))
    if below:
        r = pip_accepts(wheel, below, tmp)
        c.check(r.returncode != 0 and "requires a different Python" in r.stdout,
                f"pip refuses the wheel for Python {below}, below requires-python")


def interpreters(given, versions):
    """{version: interpreter} of those given, else of python3.X on PATH that run."""
    found = {}
    for name in given or [f"python{v}" for v in versions] + [sys.executable]:
        path = shutil.which(name)
        r = run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]) if path else None
        if r is None or r.returncode != 0:
            if given:
                sys.exit(f"check_wheels: {name} does not run")
            continue
        found.setdefault(r.stdout.strip(), path)
    return found


def check_installs(c, wheel, versions, given, deps, tmp):
    found = interpreters(given, versions)
    print(f"fresh venvs of Python {', '.join(sorted(found, key=minor))}"
          f" (dry-run only: {', '.join(v for v in versions if v not in found) or 'none'})")
    for version, python in sorted(found.items(), key=lambda vp: minor(vp[0])):
        venv = os.path.join(tmp, f"venv-{version}")
        vpy = os.path.join(venv, "bin", "python")
        # With the pip that Python bundles (pip drops old Pythons, so one pip cannot serve
        # them all).
        r = run([python, "-m", "venv", venv])
        if not c.check(r.returncode == 0, f"Python {version}: a fresh venv" + failure(r)):
            continue
        pip = [vpy, "-m", "pip", "--disable-pip-version-check"]
        r = run(pip + ["install", "-q", "--no-index", "--no-deps", wheel])
        if not c.check(r.returncode == 0, f"Python {version}: pip installs the wheel" + failure(r)):
            continue
        local = pip + ["install", "-q", "--no-index", "--find-links", deps, "numpy"]
        r = run(local)
        if r.returncode != 0:
            os.makedirs(deps, exist_ok=True)
            run(pip + ["download", "-q", "--only-binary", ":all:", "-d", deps, "numpy"])
            r = run(local)
        if not c.check(r.returncode == 0, f"Python {version}: NumPy for the examples, from {deps}"
                       + ("" if r.returncode == 0 else " (none there, and pip could not download it)") + failure(r)):
            continue
        where = run([vpy, "-c", "import kvxfer; print(kvxfer.library_path)"], cwd=tmp)
        c.check(where.returncode == 0 and where.stdout.strip().startswith(venv + os.sep),
                f"Python {version}: kvxfer loads the library the wheel installed: {where.stdout.strip()}")
        for example in EXAMPLES:
            work = tempfile.mkdtemp(dir=tmp)
            r = run([vpy, example], cwd=work)
            c.check(r.returncode == 0, f"Python {version}: {os.path.relpath(example, ROOT)}: {r.stdout.strip()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="where `make wheel` put the wheel (target/wheels)")
    ap.add_argument("--python", action="append", default=[], help="an interpreter to install into (repeat); default: python3.X on PATH")
    ap.add_argument("--deps", default=os.path.join(ROOT, "target", "wheel-deps"), help="NumPy wheels for the examples")
    args = ap.parse_args()
    wheel = the_wheel(args.folder)
    c = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        manylinux = check_tags(c, wheel)
        check_library(c, wheel, manylinux, tmp)
        versions, below = supported_pythons(c, wheel)
        check_pip(c, wheel, versions, below, tmp)
        check_installs(c, wheel, versions, args.python, args.deps, tmp)
    if c.failed:
        sys.exit(f"check_wheels: {len(c.failed)} failed:\n  " + "\n  ".join(c.failed))
    print(f"check_wheels: {os.path.basename(wheel)} passed")


if __name__ == "__main__":
    main()
