"""`crucible k8s render --out DIR`: Kubernetes manifests for one job.

What it writes (one resource a file, ``kubectl apply -f DIR``):

* ``secret.yaml``: the token, a Secret (the file is mode 0600). Every
  container gets it as ``CRUCIBLE_TOKEN`` (``secretKeyRef``), never in args.
* ``pvc.yaml``: the run directory's volume, ReadWriteMany (every pod writes
  checkpoints to it), mounted at ``/crucible``; the run is
  ``/crucible/runs/NAME``.
* ``configmap.yaml`` (with ``--config``): the TOML file, mounted read-only.
* ``coordinator-service.yaml``: a Service ``NAME-coordinator`` on port 7000:
  the coordinator's stable address. Workers dial that name, so a coordinator
  pod that restarts (same or other node) is reached at the same address and
  every live worker carries on with it.
* ``coordinator.yaml``: a Job of one pod, ``crucible coordinator
  --on-sigterm leave``: a SIGTERM (pod deleted, node drained) ends that pod
  with exit 143 and the Job starts another (``restartPolicy: OnFailure``);
  the workers keep training. It exits 0 only when the training is done or
  after SIGINT to its PID 1 (``kubectl exec``: final checkpoint, every worker
  stops), which completes the Job. (A Job, not a Deployment or StatefulSet:
  those would restart a finished run.)
* ``worker-rRsS.yaml``: one Job per worker slot (the unit of failure is the
  unit of scheduling), ``restartPolicy: OnFailure``: a worker that exits
  non-zero (killed, OOM, evicted: SIGTERM exits 143, declared dead: 3) is
  restarted in place with the kubelet's exponential back-off (10 s doubling
  to 5 min, reset after 10 min of running); a pod lost with its node is
  recreated by the Job controller (``tolerationSeconds: 30`` on not-ready /
  unreachable nodes instead of 300). Each restart is a new worker process
  registering into its slot: a replacement by Crucible's rule (weights from
  a healthy replica, else the latest checkpoint). No JobSet, no gang
  failure policy: one slot's failure never restarts another pod. A worker
  binds ``0.0.0.0:7100`` and advertises ``$(POD_IP):7100`` (downward API).
* Probes: ``grpc`` probes on each server's port, i.e. the standard
  ``grpc.health.v1.Health/Check``: a startup probe (torch imports slowly),
  readiness, and liveness (a hung worker, e.g. SIGSTOPped, is restarted).

The manifests are YAML written by a small emitter (block style, every string
double-quoted), so rendering needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from typing import NoReturn

from crucible import exits
from crucible.files import dir_problem

COORD_PORT = 7000
WORKER_PORT = 7100
MOUNT = "/crucible"
CONFIG_MOUNT = "/etc/crucible"

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


# ---- YAML -----------------------------------------------------------------------------------------

def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return json.dumps(v)
    return json.dumps(str(v))   # a JSON string is a valid YAML double-quoted scalar


def to_yaml(obj, indent: int = 0) -> str:
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return pad + "{}\n"
        out = []
        for k, v in obj.items():
            key = _scalar(str(k)) if not re.fullmatch(r"[A-Za-z0-9_.\-/]+", str(k)) else str(k)
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{key}:\n{to_yaml(v, indent + 2)}")
            else:
                out.append(f"{pad}{key}: {_scalar(v) if not isinstance(v, (dict, list)) else ('{}' if isinstance(v, dict) else '[]')}\n")
        return "".join(out)
    if isinstance(obj, list):
        out = []
        for v in obj:
            if isinstance(v, (dict, list)) and v:
                body = to_yaml(v, indent + 2)
                out.append(f"{pad}- {body[indent + 2:]}")
            else:
                out.append(f"{pad}- {_scalar(v) if not isinstance(v, (dict, list)) else ('{}' if isinstance(v, dict) else '[]')}\n")
        return "".join(out)
    return pad + _scalar(obj) + "\n"


# ---- manifests ------------------------------------------------------------------------------------

def _labels(name: str, component: str, slot: str | None = None) -> dict:
    lab = {"app.kubernetes.io/name": "crucible", "app.kubernetes.io/instance": name,
           "app.kubernetes.io/component": component}
    if slot:
        lab["crucible.dev/slot"] = slot
    return lab


def _meta(name: str, ns: str | None, labels: dict) -> dict:
    m = {"name": name, "labels": labels}
    if ns:
        m["namespace"] = ns
    return m


def _probes(port: int) -> dict:
    grpc = {"port": port}
    return {
        # torch and the model build take a while on a cold node: up to 5 minutes
        "startupProbe": {"grpc": grpc, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 60},
        "readinessProbe": {"grpc": grpc, "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 2},
        "livenessProbe": {"grpc": grpc, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
    }


def _pod(o, component: str, slot: str | None, args: list[str], port: int, port_name: str,
         grace: int, resources: dict) -> dict:
    env = [{"name": "CRUCIBLE_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{o.name}-token", "key": "token"}}},
           {"name": "OMP_NUM_THREADS", "value": "1"},
           {"name": "PYTHONUNBUFFERED", "value": "1"},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    mounts = [{"name": "run", "mountPath": MOUNT}]
    volumes = [{"name": "run", "persistentVolumeClaim": {"claimName": f"{o.name}-run"}}]
    if o.config:
        mounts.append({"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True})
        volumes.append({"name": "config", "configMap": {"name": f"{o.name}-config"}})
    container = {"name": component, "image": o.image, "imagePullPolicy": "IfNotPresent",
                 "command": ["python", "-m", "crucible"], "args": args,
                 "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}],
                 "env": env, "volumeMounts": mounts, "resources": resources, **_probes(port)}
    spec = {"restartPolicy": "OnFailure", "terminationGracePeriodSeconds": grace,
            "containers": [container], "volumes": volumes,
            # A pod on a node that stops answering is evicted after 30 s (default 300 s):
            # the Job controller then starts the slot again on another node.
            "tolerations": [{"key": k, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30}
                            for k in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")]}
    if o.service_account:
        spec["serviceAccountName"] = o.service_account
    return {"metadata": {"labels": _labels(o.name, component, slot)}, "spec": spec}


def _job(o, name: str, component: str, slot: str | None, pod: dict) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": _meta(name, o.namespace, _labels(o.name, component, slot)),
            "spec": {"completions": 1, "parallelism": 1,
                     # Restarts of the one pod count against backoffLimit: a slot may fail many
                     # times in a long run, each one a replacement.
                     "backoffLimit": o.backoff_limit,
                     "template": pod}}


def _resources(cpu: str, memory: str, gpus: int) -> dict:
    req = {}
    if cpu:
        req["cpu"] = cpu
    if memory:
        req["memory"] = memory
    res = {"requests": req} if req else {}
    if gpus:
        res["limits"] = {"nvidia.com/gpu": gpus}
    return res


def render(o, cfg, token: str, config_text: str | None) -> dict[str, list[dict]]:
    """File name -> the resources in it."""
    R, S = cfg.job.replicas, cfg.job.stages
    run_dir = f"{MOUNT}/runs/{o.name}"
    coord_addr = f"{o.name}-coordinator:{COORD_PORT}"
    files: dict[str, list[dict]] = {}
    files["secret.yaml"] = [{"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                             "metadata": _meta(f"{o.name}-token", o.namespace, _labels(o.name, "token")),
                             "stringData": {"token": token}}]
    pvc_spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": o.storage}}}
    if o.storage_class:
        pvc_spec["storageClassName"] = o.storage_class
    files["pvc.yaml"] = [{"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                          "metadata": _meta(f"{o.name}-run", o.namespace, _labels(o.name, "run-dir")),
                          "spec": pvc_spec}]
    if config_text is not None:
        files["configmap.yaml"] = [{"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": _meta(f"{o.name}-config", o.namespace, _labels(o.name, "config")),
                                    "data": {"config.toml": config_text}}]
    files["coordinator-service.yaml"] = [{
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(f"{o.name}-coordinator", o.namespace, _labels(o.name, "coordinator")),
        "spec": {"selector": _labels(o.name, "coordinator"),
                 "ports": [{"name": "grpc", "port": COORD_PORT, "targetPort": "grpc", "protocol": "TCP"}],
                 # Workers reach a new coordinator pod at once: no NotReady wait.
                 "publishNotReadyAddresses": True}}]
    cargs = ["coordinator", "--run-dir", run_dir, "--bind", f"0.0.0.0:{COORD_PORT}", "--on-sigterm", "leave"]
    if o.config:
        cargs += ["--config", f"{CONFIG_MOUNT}/config.toml"]
    if o.resume:
        cargs.append("--resume")
    cargs += list(o.overrides) + [f"net.advertise={coord_addr}"]
    coord_pod = _pod(o, "coordinator", None, cargs, COORD_PORT, "grpc",
                     grace=int(cfg.checkpoint.preemption_timeout_s) + 30, resources=_resources("1", "1Gi", 0))
    files["coordinator.yaml"] = [_job(o, f"{o.name}-coordinator", "coordinator", None, coord_pod)]
    device = o.device or ("cuda:0" if o.gpus_per_slot else "cpu")
    for r in range(R):
        for s in range(S):
            slot = f"r{r}s{s}"
            wargs = ["worker", "--coordinator", coord_addr, "--replica", str(r), "--stage", str(s),
                     "--bind", f"0.0.0.0:{WORKER_PORT}", "--advertise", f"$(POD_IP):{WORKER_PORT}",
                     "--device", device]
            pod = _pod(o, "worker", slot, wargs, WORKER_PORT, "grpc", grace=30,
                       resources=_resources(o.cpu, o.memory, o.gpus_per_slot))
            files[f"worker-{slot}.yaml"] = [_job(o, f"{o.name}-{slot}", "worker", slot, pod)]
    return files


def write(out_dir: str, files: dict[str, list[dict]]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, docs in files.items():
        path = os.path.join(out_dir, name)
        text = "---\n".join(to_yaml(d) for d in docs)
        mode = 0o600 if any(d.get("kind") == "Secret" for d in docs) else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        paths.append(path)
    return paths


# the files a render writes whose set depends on the job: a re-render into the same --out removes
# those of an earlier one that this one does not write (`kubectl apply -f DIR` would apply them), and
# only those a render wrote: a file of that name whose manifest carries crucible's labels (see _labels)
_VARIABLE = re.compile(r"^(worker-r\d+s\d+|configmap)\.yaml$")


def _label_line(key: str, value: str) -> re.Pattern:
    return re.compile(rf'^\s*{re.escape(key)}:\s*(?:"{value}"|\'{value}\'|{value})\s*$', re.M)


_OURS = _label_line("app.kubernetes.io/name", "crucible")
# the component label of what each file render writes holds (see render)
_COMPONENT = {"secret.yaml": "token", "pvc.yaml": "run-dir", "configmap.yaml": "config",
              "coordinator-service.yaml": "coordinator", "coordinator.yaml": "coordinator"}


def _rendered(path: str, name: str) -> bool:
    """The file at ``path`` is a manifest a render wrote (crucible's labels,
    the component its name says); a user's own file of that name is not."""
    try:
        with open(path, errors="replace") as f:
            text = f.read(1 << 16)
    except OSError:
        return False
    component = _label_line("app.kubernetes.io/component", _COMPONENT.get(name, "worker"))
    return bool(_OURS.search(text) and component.search(text))


def foreign(out_dir: str, files: dict[str, list[dict]]) -> list[str]:
    """The files of ``files`` already in ``out_dir`` that no render wrote (a
    user's own configmap.yaml): a render would overwrite them, so it refuses."""
    return sorted(n for n in files if os.path.lexists(p := os.path.join(out_dir, n)) and not _rendered(p, n))


def remove_stale(out_dir: str, files: dict[str, list[dict]]) -> list[str]:
    """Remove the manifests of an earlier render in ``out_dir`` that ``files``
    does not have (worker Jobs of slots this job lacks, a ConfigMap now that
    no --config is given); their names, sorted by slot. A file of such a name
    that no render wrote (a user's own configmap.yaml) is left, unmentioned."""
    stale = sorted((n for n in os.listdir(out_dir) if _VARIABLE.match(n) and n not in files
                    and _rendered(os.path.join(out_dir, n), n)),
                   key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)])
    for name in stale:
        os.unlink(os.path.join(out_dir, name))
    return stale


def _refuse(line: str) -> NoReturn:
    """A bad flag: one line, exit status 2 (USAGE), before anything is written."""
    print(f"crucible k8s: {line}", file=sys.stderr)
    raise SystemExit(exits.USAGE)


def cmd_render(args) -> int:
    from crucible import rpc
    from crucible.config import Config

    if not _NAME.match(args.name) or len(args.name) > 40:
        _refuse(f"--name {args.name!r} must be a DNS label of at most 40 characters "
                f"(lower-case letters, digits, '-')")
    if args.namespace is not None and (not _NAME.match(args.namespace) or len(args.namespace) > 63):
        _refuse(f"--namespace {args.namespace!r} must be a DNS label (RFC 1123) of at most 63 characters: "
                f"lower-case letters, digits and '-', starting and ending with a letter or digit")
    if not args.image.strip():
        _refuse("--image must name a container image (got an empty string)")
    problem = dir_problem(args.out, make=True)
    if problem:
        _refuse(f"--out {args.out}: {problem}")
    overrides = list(args.overrides)
    for key, val in (("job.replicas", args.replicas), ("job.stages", args.stages), ("train.steps", args.steps)):
        if val is not None:
            overrides.append(f"{key}={val}")
    cfg = Config.load(args.config, overrides)      # a bad key fails here, named
    if cfg.job.mps == "on":
        raise exits.UsageError("k8s render: job.mps=on is for crucible launch on one machine; on Kubernetes GPU "
                         "sharing is the device plugin's (MPS or time-slicing): leave job.mps off")
    config_text = None
    if args.config:
        with open(args.config) as f:
            config_text = f.read()
    args.overrides = overrides
    token = os.environ.get(rpc.TOKEN_ENV) or rpc.new_token()
    files = render(args, cfg, token, config_text)
    theirs = foreign(args.out, files)
    if theirs:
        _refuse(f"--out {args.out}: {', '.join(theirs)} not written by crucible k8s render (no crucible labels); "
                f"a render would overwrite {'them' if len(theirs) > 1 else 'it'}: move "
                f"{'them' if len(theirs) > 1 else 'it'} or choose another --out")
    try:
        paths = write(args.out, files)
        stale = remove_stale(args.out, files)
    except OSError as e:      # (a disk full; --out changed since the check above)
        print(f"crucible k8s: --out {args.out}: {e}", file=sys.stderr)
        return exits.ERROR
    print(f"crucible k8s: {len(paths)} files in {args.out} ({cfg.job.replicas} x {cfg.job.stages} worker Jobs, "
          f"coordinator Job + Service, Secret, PVC); apply with: kubectl apply -f {shlex.quote(args.out)}",
          file=sys.stderr)
    if stale:
        shown = ", ".join(stale[:4]) + (f" and {len(stale) - 4} more" if len(stale) > 4 else "")
        print(f"crucible k8s: removed {len(stale)} manifest(s) of an earlier render that this job does not have: "
              f"{shown}", file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("k8s", help="Kubernetes manifests for a job")
    ss = p.add_subparsers(dest="k8s_cmd", required=True)
    r = ss.add_parser("render", help="write the manifests (coordinator, one Job per worker slot, Secret, PVC)")
    r.add_argument("--out", required=True, help="directory to write the manifests into")
    r.add_argument("--name", default="crucible", help="name prefix of every resource (a DNS label)")
    r.add_argument("--namespace", help="namespace of every resource (default: kubectl's)")
    r.add_argument("--image", required=True, help="container image with crucible installed")
    r.add_argument("--config", help="TOML file with the job's configuration (becomes a ConfigMap)")
    r.add_argument("--replicas", type=int)
    r.add_argument("--stages", type=int)
    r.add_argument("--steps", type=int)
    r.add_argument("--resume", action="store_true",
                   help="every start of the coordinator's pod continues from the latest checkpoint: to continue a "
                        "stopped run, not for a running one")
    r.add_argument("--storage", default="10Gi", help="size of the shared run-directory volume")
    r.add_argument("--storage-class", help="a StorageClass offering ReadWriteMany (NFS, CephFS, EFS, Filestore...)")
    r.add_argument("--cpu", default="1", help="CPU request of each worker")
    r.add_argument("--memory", default="2Gi", help="memory request of each worker")
    r.add_argument("--gpus-per-slot", type=int, default=0, help="nvidia.com/gpu limit of each worker (device cuda:0)")
    r.add_argument("--device", help="worker device (default cpu, or cuda:0 with --gpus-per-slot)")
    r.add_argument("--backoff-limit", type=int, default=10000, help="restarts a slot's Job allows in all")
    r.add_argument("--service-account", help="service account of every pod")
    r.add_argument("overrides", nargs="*", metavar="key=value")
    r.set_defaults(func=cmd_render)
