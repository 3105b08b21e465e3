"""A worker that dies of an error after its shard of the end save was taken
exits at once with its error.

A worker that ends normally waits for the end save's commit before it exits
(crucible/worker/checkpointing.py, ``close``); one that died of an error
waited too, its error told but the process still there until the commit
(here held 15 s by ``debug.commit_delay_s``; found by a review: 20 s of
'save in flight' in its exit line). The error is the real thing, raised in
the worker process: stage 0's evaluation after the last step fails (a
``sitecustomize`` on PYTHONPATH, here only, makes it raise).
"""

from __future__ import annotations

import os
import re
import time

from conftest import TINY, Job, child_env

SHIM = '''
import importlib.abc, importlib.util, sys


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "crucible.worker.driver":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            evaluate = module.Driver._maybe_evaluate

            def failing(self):
                if self.progress.step >= self.cfg.train.steps:
                    raise RuntimeError("evaluation failed after the end save")
                return evaluate(self)

            module.Driver._maybe_evaluate = failing

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
'''


def test_a_worker_dying_of_an_error_after_its_end_shard_exits_at_once(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SHIM)
    env = dict(child_env(), PYTHONPATH=str(shim))
    job = Job(tmp_path / "run", ["--replicas", "1", "--stages", "2", "--steps", "6", "--respawn-delay", "-1"],
              TINY + ["checkpoint.enable_checkpointing=true", "checkpoint.enable_continuous_checkpointing=false",
                      "checkpoint.checkpoint_period=1000", "debug.commit_delay_s=15"], env=env)
    log_path = os.path.join(job.run_dir, "logs", "r0s0.log")
    try:
        t_end, said = time.monotonic() + 90, None
        while said is None:
            assert time.monotonic() < t_end, f"r0s0 never exited:\n{job.output()}"
            if os.path.exists(log_path):
                with open(log_path, errors="replace") as f:
                    said = re.search(r"exiting with (\d+) \(save in flight ([\d.]+)s", f.read())
            time.sleep(0.1)
        out = job.output()
        assert "RuntimeError: evaluation failed after the end save" in out, out
        assert "checkpoint of step 6: every shard in" in out, out      # its shard was taken
        assert said.group(1) == "1" and float(said.group(2)) < 5.0, (said.group(0), out)
    finally:
        job.kill()
