"""Prints the requirements of an installed distribution, one a line as pip reads them,
less its extras' and those of the distributions named after it:
`python requirements_of.py DIST [LEFT_OUT...]`. `make integration-test` installs a runtime
release whose pins name a package the registry lacks this way (the Makefile's
RUNTIME_LEFT_OUT_<runtime>-<version>)."""

import re
import sys
from importlib.metadata import requires


def name(requirement: str) -> str:
    """A requirement's distribution name, normalized (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def main() -> None:
    dist, left_out = sys.argv[1], {name(n) for n in sys.argv[2:]}
    for r in requires(dist) or []:
        if "extra ==" not in r and name(r) not in left_out:
            print(r)


if __name__ == "__main__":
    main()
