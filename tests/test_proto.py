import subprocess
import sys

from conftest import ROOT


def test_generated_code_is_fresh():
    """crucible/_pb is generated from proto/crucible.proto and must match it."""
    out = subprocess.run([sys.executable, "-m", "crucible.gen_proto", "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_control_plane_never_imports_torch():
    code = ("import sys, crucible.cli, crucible.launch, crucible.status, crucible.coordinator.server, "
            "crucible.config, crucible.rpc, crucible.kill; assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
