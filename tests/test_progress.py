"""Live progress lines: on a terminal only, so JSON output and logs stay clean."""

from __future__ import annotations

import io
import json
import os
import select
import subprocess
import time

import torch

from conftest import ROOT, child_env, crucible_cmd
from crucible.checkpoint import store
from crucible.checkpoint.shard import write_shard
from crucible.progress import Progress


def test_progress_writes_only_when_enabled_and_erases_its_line():
    buf = io.StringIO()            # not a terminal
    p = Progress("work", total=10, stream=buf)
    p.advance(5)
    p.close()
    assert buf.getvalue() == ""
    buf = io.StringIO()
    p = Progress("verifying", total=4e6, unit=" MB", scale=1e6, stream=buf, enabled=True)
    p.advance(1e6)
    p.advance(3e6)                 # the end is always drawn
    p.close()
    out = buf.getvalue()
    assert "\rverifying: 1/4 MB (25%)" in out and "\rverifying: 4/4 MB (100%)" in out
    assert out.endswith("\r") and out.rstrip("\r").endswith(" ")      # erased


def _checkpoint(root) -> None:
    d = store.tmp_dir(root, 7)
    infos = [write_shard(d, store.shard_name(0, s), {"x": torch.arange(50_000.0) + s}) for s in range(2)]
    store.commit(root, 7, [{k: i[k] for k in ("name", "bytes", "checksum")} for i in infos])


def test_ckpt_verify_shows_progress_on_a_terminal_and_not_in_a_pipe(tmp_path):
    _checkpoint(tmp_path / "checkpoints")
    env = child_env()
    env.pop("CRUCIBLE_PROGRESS", None)
    # In a pipe: JSON on stdout, nothing on stderr.
    out = subprocess.run(crucible_cmd("ckpt", "verify", str(tmp_path), "--json"), capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
    assert json.loads(out.stdout)["resume_step"] == 7
    # stderr on a terminal (a pseudo-terminal): the live line goes there, stdout stays the JSON.
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(crucible_cmd("ckpt", "verify", str(tmp_path), "--json"), stdout=subprocess.PIPE,
                                stderr=slave, cwd=ROOT, env=env, start_new_session=True)
        os.close(slave)
        stdout, _ = proc.communicate(timeout=60)
        seen, t_end = b"", time.monotonic() + 5
        while time.monotonic() < t_end:
            r, _, _ = select.select([master], [], [], 0.2)
            if not r:
                break
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(master)
    assert proc.returncode == 0 and json.loads(stdout)["resume_step"] == 7
    assert b"verifying step 7:" in seen and b"(100%)" in seen, seen
