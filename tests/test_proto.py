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


_FRAME_FAULTS = """
import os, resource, sys
import torch
from crucible import procs, wire
from crucible._pb import crucible_pb2 as pb
torch.set_num_threads(1)
tuned = procs.keep_large_buffers()
t = torch.randn(4, 512, 1024)      # 8 MB, a boundary of a 200M-parameter model in fp32
def frame():                        # the data path of one activation, both ends
    f = pb.Frame(kind=pb.Frame.FORWARD, tensor=wire.to_wire(t))
    g = pb.Frame.FromString(f.SerializeToString())
    return wire.from_wire(g.tensor, torch.float32, (4, 512, 1024))
for _ in range(3):
    frame()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    assert torch.equal(frame(), t)
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_frames_of_megabytes_reuse_their_memory():
    """A worker keeps glibc from mapping fresh pages for every frame of a few MB
    (a page fault each 4 KiB, a 7x slower frame); $CRUCIBLE_MALLOC=glibc keeps
    glibc's own behaviour."""
    import os

    if not sys.platform.startswith("linux"):
        return

    def faults(**env):
        out = subprocess.run([sys.executable, "-c", _FRAME_FAULTS], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        tuned, n = out.stdout.split()
        return tuned == "True", int(n)

    tuned, n = faults()
    plain, m = faults(CRUCIBLE_MALLOC="glibc")
    assert tuned and not plain
    assert m > 10 * 2048, m                   # glibc: at least a buffer's pages each frame
    assert n < m / 20, (n, m)
