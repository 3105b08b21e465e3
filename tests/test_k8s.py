"""`crucible k8s render`: the manifests pass the Kubernetes schemas (kubernetes-validate,
which bundles them: no network) and wire together (Service -> coordinator pod,
Secret -> every container, PVC -> every pod, probes on each server's port)."""

from __future__ import annotations

import os
import stat
import subprocess

import kubernetes_validate
import pytest
import yaml

from conftest import ROOT, child_env, crucible_cmd

VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]   # grpc probes are GA from 1.27


def render(tmp_path, *extra, name="job1") -> tuple[subprocess.CompletedProcess, str]:
    out = str(tmp_path / "manifests")
    p = subprocess.run(crucible_cmd("k8s", "render", "--out", out, "--image", "registry.example/crucible:0.1",
                                    "--name", name, *extra), capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=child_env())
    return p, out


def load(out: str) -> dict[str, list[dict]]:
    docs = {}
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            docs[name] = [d for d in yaml.safe_load_all(f) if d is not None]
    return docs


@pytest.fixture(scope="module")
def manifests(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k8s")
    cfg = tmp / "job.toml"
    cfg.write_text('[train]\nsteps = 500\n\n[model]\nn_layer = 3\n')
    p, out = render(tmp, "--replicas", "2", "--stages", "3", "--config", str(cfg), "--namespace", "training",
                    "--gpus-per-slot", "1", "--storage-class", "nfs", "fault.heartbeat_timeout_s=5")
    assert p.returncode == 0, p.stderr
    return out, load(out)


def test_every_manifest_passes_the_kubernetes_schemas(manifests):
    out, docs = manifests
    n = 0
    for name, items in docs.items():
        for d in items:
            for v in VERSIONS:
                kubernetes_validate.validate(d, v, strict=True)   # raises on any schema violation
                n += 1
    assert n == len(VERSIONS) * (6 + 5)   # 6 worker Jobs; coordinator Job + Service, Secret, PVC, ConfigMap


def test_the_validator_rejects_a_broken_manifest(manifests):
    _, docs = manifests
    job = docs["worker-r0s1.yaml"][0]
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "seven thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(job))
    bad["spec"]["template"]["spec"]["restartPolicyy"] = "Always"     # unknown field: refused in strict mode
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_one_restartable_job_per_slot_wired_to_service_secret_volume(manifests):
    out, docs = manifests
    kinds = {name: [d["kind"] for d in items] for name, items in docs.items()}
    assert kinds["coordinator-service.yaml"] == ["Service"] and kinds["coordinator.yaml"] == ["Job"]
    workers = {n: items[0] for n, items in docs.items() if n.startswith("worker-")}
    assert sorted(workers) == [f"worker-r{r}s{s}.yaml" for r in range(2) for s in range(3)]
    secret = docs["secret.yaml"][0]
    token = secret["stringData"]["token"]
    assert len(token) >= 32
    assert stat.S_IMODE(os.stat(os.path.join(out, "secret.yaml")).st_mode) == 0o600
    pvc = docs["pvc.yaml"][0]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"] and pvc["spec"]["storageClassName"] == "nfs"
    svc = docs["coordinator-service.yaml"][0]
    coord = docs["coordinator.yaml"][0]
    all_jobs = [coord] + list(workers.values())
    for job in all_jobs:
        assert job["metadata"]["namespace"] == "training"
        pod = job["spec"]["template"]
        spec = pod["spec"]
        assert spec["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 1000
        (c,) = spec["containers"]
        env = {e["name"]: e for e in c["env"]}
        ref = env["CRUCIBLE_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "token"}
        assert all(token not in a for a in c["command"] + c["args"]), "token on a command line"
        claims = [v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert claims == [pvc["metadata"]["name"]]
        port = c["ports"][0]["containerPort"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port     # grpc.health.v1 on the server's own port
    # The Service selects the coordinator's pod (and no worker) on its named port.
    sel = svc["spec"]["selector"]
    labels = coord["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sel.items())
    assert not any(all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
                   for w in workers.values())
    (cc,) = coord["spec"]["template"]["spec"]["containers"]
    assert svc["spec"]["ports"][0]["targetPort"] == cc["ports"][0]["name"]
    assert "--on-sigterm" in cc["args"] and cc["args"][cc["args"].index("--on-sigterm") + 1] == "leave"
    assert "fault.heartbeat_timeout_s=5" in cc["args"] and "--config" in cc["args"]
    addr = f"{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    for name, w in workers.items():
        (c,) = w["spec"]["template"]["spec"]["containers"]
        a = c["args"]
        slot = name[len("worker-"):-len(".yaml")]
        assert a[a.index("--coordinator") + 1] == addr
        assert f"r{a[a.index('--replica') + 1]}s{a[a.index('--stage') + 1]}" == slot
        assert a[a.index("--advertise") + 1] == f"$(POD_IP):{c['ports'][0]['containerPort']}"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and a[a.index("--device") + 1] == "cuda:0"
        assert w["spec"]["template"]["metadata"]["labels"]["crucible.dev/slot"] == slot
    assert docs["configmap.yaml"][0]["data"]["config.toml"].startswith("[train]")


def test_bad_input_is_one_line(tmp_path):
    p, _ = render(tmp_path, name="Bad_Name")
    assert p.returncode != 0 and "--name" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p, _ = render(tmp_path, "train.setps=3")
    assert p.returncode == 2 and "train.setps" in p.stderr and "train.steps" in p.stderr


def test_a_render_into_an_earlier_renders_directory_leaves_none_of_its_manifests(tmp_path):
    """A 1 x 2 render into the --out of a 2 x 3 one with --config left
    worker-r0s2.yaml, worker-r1s*.yaml and configmap.yaml there, which
    `kubectl apply -f DIR` applies with the new ones."""
    cfg = tmp_path / "job.toml"
    cfg.write_text("[train]\nsteps = 50\n")
    p, out = render(tmp_path, "--replicas", "2", "--stages", "3", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    (tmp_path / "manifests" / "notes.yaml").write_text("kind: mine\n")     # not a render's: kept
    p, out = render(tmp_path, "--replicas", "1", "--stages", "2")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(out)) == ["coordinator-service.yaml", "coordinator.yaml", "notes.yaml", "pvc.yaml",
                                       "secret.yaml", "worker-r0s0.yaml", "worker-r0s1.yaml"]
    assert ("removed 5 manifest(s) of an earlier render that this job does not have: configmap.yaml, "
            "worker-r0s2.yaml, worker-r1s0.yaml, worker-r1s1.yaml and 1 more") in p.stderr, p.stderr


def test_a_render_leaves_manifests_it_did_not_write(tmp_path):
    """remove_stale deleted any configmap.yaml or worker-r*s*.yaml in --out,
    whoever wrote it: a user's own ConfigMap went with a re-render."""
    out = tmp_path / "manifests"
    out.mkdir()
    mine = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: my-settings\n  labels:\n    app: mine\n"
            "data:\n  level: \"3\"\n")
    (out / "configmap.yaml").write_text(mine)
    (out / "worker-r9s9.yaml").write_text("kind: Job\nmetadata:\n  name: someone-elses\n")
    p, _ = render(tmp_path, "--replicas", "1", "--stages", "2")
    assert p.returncode == 0, p.stderr
    assert (out / "configmap.yaml").read_text() == mine and (out / "worker-r9s9.yaml").exists()
    assert "removed" not in p.stderr and "configmap" not in p.stderr, p.stderr
    # an earlier render's, whatever its --name, still goes
    p, _ = render(tmp_path, "--replicas", "2", "--stages", "2", name="other")
    assert p.returncode == 0, p.stderr
    p, _ = render(tmp_path, "--replicas", "1", "--stages", "2")
    assert p.returncode == 0, p.stderr
    assert sorted(n for n in os.listdir(out) if n.startswith("worker-")) == \
        ["worker-r0s0.yaml", "worker-r0s1.yaml", "worker-r9s9.yaml"]
    assert "removed 2 manifest(s) of an earlier render that this job does not have: worker-r1s0.yaml, " \
           "worker-r1s1.yaml" in p.stderr, p.stderr
    assert (out / "configmap.yaml").read_text() == mine


def test_a_render_refuses_to_overwrite_a_file_it_did_not_write(tmp_path):
    """`render --config` overwrote a user's own configmap.yaml in --out (and
    any render a user's secret.yaml, pvc.yaml...). Now one line naming the
    files, exit 2, and --out as it was; a render's own files are rewritten."""
    cfg = tmp_path / "job.toml"
    cfg.write_text("[train]\nsteps = 50\n")
    out = tmp_path / "manifests"
    out.mkdir()
    mine = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: my-settings\ndata:\n  level: \"3\"\n"
    (out / "configmap.yaml").write_text(mine)
    (out / "pvc.yaml").write_text("kind: PersistentVolumeClaim\nmetadata:\n  name: my-data\n")
    before = sorted(os.listdir(out))
    p, _ = render(tmp_path, "--replicas", "1", "--stages", "2", "--config", str(cfg))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (f"crucible k8s: --out {out}: configmap.yaml, pvc.yaml not written by crucible k8s "
                                f"render (no crucible labels); a render would overwrite them: move them or choose "
                                f"another --out"), p.stderr
    assert sorted(os.listdir(out)) == before and (out / "configmap.yaml").read_text() == mine
    (out / "pvc.yaml").unlink()
    (out / "configmap.yaml").unlink()
    p, _ = render(tmp_path, "--replicas", "1", "--stages", "2", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    p, _ = render(tmp_path, "--replicas", "1", "--stages", "2", "--config", str(cfg))     # its own: rewritten
    assert p.returncode == 0, p.stderr
    assert load(str(out))["configmap.yaml"][0]["data"]["config.toml"] == "[train]\nsteps = 50\n"
