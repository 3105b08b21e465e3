"""Packaging: declared bounds match the generated code, the minimum-versions
constraints, and the version a running Crucible reports.

These run both from the source tree and, in .ci/packaging.sh, against the
installed wheel (tests/, .ci/ and pyproject.toml copied beside each other,
``crucible`` imported from site-packages).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata

import pytest

import crucible
from conftest import ROOT, child_env, crucible_cmd
from crucible.version import _installed_version, version

PB_DIR = os.path.dirname(importlib.util.find_spec("crucible._pb").origin)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


@pytest.fixture(scope="module")
def mc():
    return _load("min_constraints", os.path.join(ROOT, ".ci", "min_constraints.py"))


def _spec(reqs: list[str], name: str) -> str:
    for r in reqs:
        m = re.match(r"^([A-Za-z0-9._-]+)\s*(.*)$", r)
        if m.group(1).lower() == name:
            return m.group(2).replace(" ", "")
    raise AssertionError(f"{name} not declared")


def test_generated_code_states_the_declared_bounds(project):
    """protobuf/grpcio lower bounds are exactly what crucible/_pb checks at import."""
    with open(os.path.join(PB_DIR, "crucible_pb2.py")) as f:
        pb2 = f.read()
    with open(os.path.join(PB_DIR, "crucible_pb2_grpc.py")) as f:
        grpc_mod = f.read()
    gencode = re.search(r"^# Protobuf Python Version: (\d+)\.(\d+)\.(\d+)$", pb2, re.M).groups()
    checked = re.search(r"ValidateProtobufRuntimeVersion\(\s*\S+,\s*(\d+),\s*(\d+),\s*(\d+),", pb2).groups()
    assert gencode == checked
    grpc_gen = re.search(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", grpc_mod, re.M).group(1)
    deps = project["dependencies"]
    assert _spec(deps, "protobuf") == f">={'.'.join(gencode)},<{int(gencode[0]) + 1}"
    assert _spec(deps, "grpcio") == f">={grpc_gen}"
    assert _spec(project["optional-dependencies"]["test"], "grpcio-tools") == f"=={grpc_gen}"
    assert _spec(project["optional-dependencies"]["cluster"], "grpcio-health-checking") == f">={grpc_gen}"


def test_requires_python_matches_the_interpreter_floor(project):
    # crucible/config.py needs tomllib (3.11); nothing may claim less.
    assert project["requires-python"] == ">=3.11"
    assert sys.version_info >= (3, 11)


def test_min_constraints_pin_every_dependency_to_its_minimum(project, mc):
    lines = mc.constraints(os.path.join(ROOT, "pyproject.toml"), ["test", "report", "cluster"], ["torch==2.13.0"])
    pins = dict(line.split("==") for line in lines)
    declared = project["dependencies"] + [r for e in ("test", "report", "cluster")
                                          for r in project["optional-dependencies"][e]]
    assert len(pins) == len(declared)
    assert pins["torch"] == "2.13.0" and pins["protobuf"] == "7.35.1" and pins["grpcio"] == "1.85.1"
    assert pins["prometheus-client"] == _spec(declared, "prometheus-client").removeprefix(">=")


@pytest.mark.parametrize("req,err", [
    ("numpy", "no lower bound"),
    ("numpy<3", "no lower bound"),
    ("numpy>1.2", "'>' has no minimum"),
    ("numpy @ https://example.invalid/numpy.whl", "direct reference"),
    ("numpy>=1,>=2", "more than one"),
])
def test_min_constraints_refuse_a_requirement_without_a_minimum(mc, req, err):
    with pytest.raises(mc.MinError, match=err):
        mc.minimum(req)


def test_min_constraints_read_markers_and_extras(mc):
    assert mc.minimum("Foo_Bar[x] >= 1.2 ; python_version >= '3.11'") == ("foo-bar", "1.2")
    assert mc.minimum("a~=2.1") == ("a", "2.1")


def test_min_constraints_cli_names_a_bad_extra(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, ".ci", "min_constraints.py"), "--extras", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("min_constraints: pyproject.toml: no extra 'nope'")


def test_version_flag(tmp_path):
    """`crucible --version`: the version, where it runs from; no torch imported."""
    out = subprocess.run(crucible_cmd("--version"), capture_output=True, text=True, env=child_env(), cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"crucible {crucible.__version__} from {os.path.dirname(crucible.__file__)} ("), line
    assert "grpcio 1." in line and "protobuf 7." in line
    code = ("import sys\nfrom crucible.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0, e.code\nassert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr


def test_version_is_the_installed_one():
    """From a wheel, the version is the installed distribution's; from a source
    tree (or an editable install) it is crucible.__version__."""
    installed = os.path.realpath(crucible.__file__).startswith(
        os.path.realpath(sysconfig.get_paths()["purelib"]) + os.sep)
    if installed:
        assert _installed_version() == metadata.version("crucible") == crucible.__version__
    else:
        assert _installed_version() is None
    assert version() == crucible.__version__


def test_benchmark_provenance_names_the_version():
    from crucible.bench.common import environment

    env = environment()
    assert env["crucible"] == version()
    json.dumps(env)
