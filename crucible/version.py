"""Which Crucible is running: ``crucible --version``, ``status --json``, benchmark provenance.

The version has one source, ``crucible.__version__`` (``pyproject.toml`` reads
it at build time), and ``version()`` reports what is actually running:

* an installed wheel: the version of the installed distribution, read with
  ``importlib.metadata``, when its files are the ones imported;
* a source tree (a checkout on ``sys.path``, or an editable install, whose
  metadata may be older than the checkout): ``crucible.__version__``.

Never imports torch (the CLI and the coordinator use it); the versions of the
dependencies come from their metadata, not from importing them.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
from importlib import metadata

import crucible

DIST = "crucible"
_DEPENDENCIES = ("torch", "grpcio", "protobuf", "numpy", "zstandard")


def _installed_version() -> str | None:
    """The version of the installed wheel whose files are the imported package.

    Only a wheel install's RECORD lists ``crucible/__init__.py``; an editable
    install's does not, and a source tree's ``crucible.egg-info`` has no RECORD
    (its version is the one of its last build), so both fall back."""
    here = os.path.realpath(crucible.__file__)
    for dist in metadata.distributions(name=DIST):
        try:
            record = dist.read_text("RECORD") or ""
            if not any(line.split(",", 1)[0] == "crucible/__init__.py" for line in record.splitlines()):
                continue
            if os.path.realpath(str(dist.locate_file("crucible/__init__.py"))) == here:
                return dist.version
        except Exception:  # noqa: BLE001 - unreadable metadata: not ours
            continue
    return None


@functools.cache
def version() -> str:
    """The running Crucible's version, e.g. ``0.1.0``."""
    return _installed_version() or crucible.__version__


def dependency_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (None when absent)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def describe() -> str:
    """One line for ``crucible --version``: the version, where it runs from,
    Python and the core dependencies."""
    where = os.path.dirname(os.path.abspath(crucible.__file__))
    deps = ", ".join(f"{d} {dependency_version(d) or 'missing'}" for d in _DEPENDENCIES)
    return f"crucible {version()} from {where} (python {platform.python_version()}; {deps})"


class VersionAction(argparse.Action):
    """``--version``: print ``describe()`` and exit 0 (computed only when asked)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print the version (and where it runs from, Python and dependency versions) and exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe(), file=sys.stdout, flush=True)
        parser.exit(0)
