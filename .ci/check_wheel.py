"""Check a built wheel holds what Crucible needs at run time, and nothing else.

    python .ci/check_wheel.py dist/crucible-*.whl SOURCE_DIR

* every module of the package in SOURCE_DIR/crucible is in the wheel (the
  generated crucible/_pb modules included), and every non-Python file there
  too (none today: a data file added later must ship);
* nothing outside the crucible package (no tests/, no bench/ results);
* the metadata: the version of crucible/__init__.py, Requires-Python, the
  dependencies of pyproject.toml, the extras, and the ``crucible`` command.
"""

from __future__ import annotations

import email.parser
import os
import re
import sys
import tomllib
import zipfile


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wheel, src = argv
    errors: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = [n for n in names if n.split("/")[0].endswith(".dist-info")]
        dist_info = info[0].split("/")[0] if info else ""
        meta = email.parser.Parser().parsestr(z.read(f"{dist_info}/METADATA").decode()) if dist_info else None
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode() if dist_info else ""

    want = set()
    for root, dirs, files in os.walk(os.path.join(src, "crucible")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if not f.endswith((".pyc", ".pyo")):
                want.add(os.path.relpath(os.path.join(root, f), src).replace(os.sep, "/"))
    want |= {"crucible/_pb/__init__.py", "crucible/_pb/crucible_pb2.py", "crucible/_pb/crucible_pb2_grpc.py"}
    for n in sorted(want - names):
        errors.append(f"missing from the wheel: {n}")
    for n in sorted(names):
        top = n.split("/")[0]
        if top != "crucible" and top != dist_info:
            errors.append(f"not part of the package: {n}")
        elif n.endswith((".pyc", ".pyo")) or "/__pycache__/" in n:
            errors.append(f"compiled file in the wheel: {n}")

    with open(os.path.join(src, "crucible", "__init__.py")) as f:
        version = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.M).group(1)
    with open(os.path.join(src, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    if meta is None:
        errors.append("no .dist-info in the wheel")
    else:
        if meta["Version"] != version:
            errors.append(f"wheel version {meta['Version']} != crucible.__version__ {version}")
        if meta["Requires-Python"] != project["requires-python"]:
            errors.append(f"Requires-Python {meta['Requires-Python']!r} != {project['requires-python']!r}")

        def norm(r: str) -> str:
            """'name>=1,<2; marker' and 'name<2,>=1;marker' compare equal."""
            req, _, marker = re.sub(r"\s+", "", r).partition(";")
            name, spec = re.match(r"^([A-Za-z0-9._\[\]-]+)(.*)$", req).groups()
            return f"{name.lower()}{','.join(sorted(spec.split(',')))};{marker}"

        got = {norm(r) for r in meta.get_all("Requires-Dist") or []}
        declared = {norm(r) for r in project["dependencies"]}
        for e, reqs in project.get("optional-dependencies", {}).items():
            declared |= {norm(f'{r};extra=="{e}"') for r in reqs}
        for r in sorted(declared - got):
            errors.append(f"dependency missing from the metadata: {r}")
        extras = set(meta.get_all("Provides-Extra") or [])
        for e in sorted(set(project.get("optional-dependencies", {})) - extras):
            errors.append(f"extra missing from the metadata: {e}")
    if not re.search(r"^crucible = crucible\.cli:main$", entry_points, re.M):
        errors.append("no `crucible` console script in entry_points.txt")

    for e in errors:
        print(f"check_wheel: {e}", file=sys.stderr)
    if errors:
        return 1
    n_py = sum(n.endswith(".py") for n in names)
    print(f"check_wheel: {os.path.basename(wheel)}: {n_py} modules, version {version}, "
          f"Requires-Python {project['requires-python']}, extras {', '.join(sorted(extras))}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
