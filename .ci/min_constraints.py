"""A pip constraints file pinning every dependency of pyproject.toml to its declared minimum.

    python .ci/min_constraints.py [--extras test,report,cluster] [--pin torch==2.13.0] > min.txt
    pip install -c min.txt "dist/crucible-*.whl[test,report,cluster]"

Reads ``[project] dependencies`` and the named ``[project.optional-dependencies]``
with tomllib and writes ``name==X`` for each, where X is the requirement's
lower bound (``>=X``, ``~=X`` or ``==X``). A requirement without a lower bound
is an error: every dependency must say which oldest version it works with.
``--pin NAME==V`` replaces one minimum (torch: the CPU build that
launch/setup.sh installs, since PyPI's older Linux wheels of torch are
multi-GB CUDA builds).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")
_CLAUSE = re.compile(r"^(~=|==|!=|<=|>=|<|>)\s*([A-Za-z0-9.*+!_-]+)$")


class MinError(ValueError):
    pass


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def minimum(req: str) -> tuple[str, str]:
    """(normalized name, minimum version) of one PEP 508 requirement string."""
    m = _REQ.match(req)
    if not m:
        raise MinError(f"cannot parse requirement {req!r}")
    name, spec = normalize(m.group(1)), m.group(3).strip()
    if spec.startswith("@"):
        raise MinError(f"{req!r}: a direct reference has no minimum version")
    lows = []
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        c = _CLAUSE.match(clause)
        if not c:
            raise MinError(f"{req!r}: cannot parse {clause!r}")
        op, ver = c.groups()
        if op in (">=", "~=", "==") and "*" not in ver:
            lows.append(ver)
        elif op == ">":
            raise MinError(f"{req!r}: '>' has no minimum version; write '>=' with the oldest one that works")
    if not lows:
        raise MinError(f"{req!r}: no lower bound; every dependency must declare the oldest version it works with")
    if len(lows) > 1:
        raise MinError(f"{req!r}: more than one lower bound")
    return name, lows[0]


def constraints(pyproject: pathlib.Path, extras: list[str], pins: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    reqs = list(project.get("dependencies", []))
    for e in extras:
        if e not in optional:
            raise MinError(f"{pyproject.name}: no extra {e!r} (extras: {', '.join(sorted(optional))})")
        reqs += optional[e]
    mins: dict[str, str] = {}
    for r in reqs:
        name, ver = minimum(r)
        if mins.get(name, ver) != ver:
            raise MinError(f"{name}: two different minimums ({mins[name]} and {ver})")
        mins[name] = ver
    for p in pins:
        name, sep, ver = p.partition("==")
        if not sep or not ver:
            raise MinError(f"--pin {p!r}: expected NAME==VERSION")
        if normalize(name) not in mins:
            raise MinError(f"--pin {p!r}: {name} is not a dependency")
        mins[normalize(name)] = ver
    return [f"{n}=={v}" for n, v in sorted(mins.items())]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pyproject", default=str(ROOT / "pyproject.toml"))
    ap.add_argument("--extras", default="", help="comma-separated extras to include")
    ap.add_argument("--pin", action="append", default=[], metavar="NAME==VERSION")
    args = ap.parse_args(argv)
    try:
        lines = constraints(pathlib.Path(args.pyproject), [e for e in args.extras.split(",") if e], args.pin)
    except (MinError, OSError, KeyError, tomllib.TOMLDecodeError) as e:
        print(f"min_constraints: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
