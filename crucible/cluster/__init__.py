"""Running a job under a cluster scheduler: Slurm (``slurm``, ``slurm_job``) and
Kubernetes manifests (``k8s``). None of these modules imports torch."""

from __future__ import annotations

import sys


def add_parsers(sub) -> None:
    from crucible.cluster import k8s, slurm

    slurm.add_parser(sub)
    k8s.add_parser(sub)


def main(args) -> int:
    from crucible.cluster.slurm import SlurmError

    try:
        return args.func(args)
    except SlurmError as e:
        print(f"crucible {args.cmd}: {e}", file=sys.stderr)
        return 1
