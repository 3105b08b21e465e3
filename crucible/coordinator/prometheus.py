"""Prometheus ``/metrics`` from the coordinator (``metrics.prometheus_port``).

``prometheus-client``'s HTTP server, in a thread of the coordinator, on the
interface its gRPC server binds (127.0.0.1 unless ``--bind`` says otherwise)
and the configured port (0 = any free port). The address it got is written
to ``run_dir/prometheus.addr`` and logged as a ``prometheus`` event. Like
health probes, scrapes carry no token: bind the coordinator to an interface
only the cluster reaches.

What it exports (a private registry: no process or Python collectors):

Read from the coordinator's state at each scrape (gauges)::

    crucible_replica_step{replica}              committed steps
    crucible_replica_loss{replica}              latest training loss
    crucible_replica_eval_loss{replica}         latest held-out loss
    crucible_replica_tokens_per_second{replica} over the last 64 steps (and up to now: status's tokens_per_s)
    crucible_replica_goodput{replica}           committed compute / wall time (stage 0's ledger)
    crucible_replica_state{replica,state}       1 for the replica's state (waiting|training|paused|done)
    crucible_workers{state}                     slots by worker state (alive|dead|joining|done|vacant)
    crucible_route_epoch                        route epochs in this coordinator incarnation (the
                                                low 32 bits of the epoch workers see)
    crucible_coordinator_incarnation            coordinator restarts + 1 (the epoch's high bits)
    crucible_checkpoint_latest_step             newest committed checkpoint (-1: none)
    crucible_job_finished                       1 once every replica is done

Counted from the events as they are written (counters and gauges)::

    crucible_steps_total{replica}               committed steps (stage 0's step events)
    crucible_tokens_total{replica}              tokens trained
    crucible_faults_total{kind}                 workers declared dead, ...
    crucible_route_changes_total
    crucible_steps_aborted_total{replica}
    crucible_replacements_total
    crucible_checkpoints_total{result}          committed | aborted
    crucible_checkpoint_stall_seconds           last committed save's largest snapshot stall
    crucible_checkpoint_persist_seconds         its longest background write
    crucible_checkpoint_bytes                   its size
    crucible_outer_rounds_total{stage}
    crucible_outer_bytes_total{direction}       sent | received by the workers (SparseLoCo payloads)
"""

from __future__ import annotations

from crucible.coordinator import membership
from crucible.files import atomic_write

import logging
import os

log = logging.getLogger("crucible.prometheus")

WORKER_STATES = ("alive", "dead", "joining", "done", "vacant")


class PrometheusExporter:
    def __init__(self, coord, host: str, port: int):
        from crucible.extras import need

        need("prometheus_client", "metrics.prometheus_port")
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        prometheus_client.disable_created_metrics()    # no *_created series: the counters start with the job

        self.c = coord
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.steps = Counter("crucible_steps", "Committed steps (stage 0)", ["replica"], registry=reg)
        self.tokens = Counter("crucible_tokens", "Tokens trained", ["replica"], registry=reg)
        self.faults = Counter("crucible_faults", "Faults handled (workers declared dead, ...)", ["kind"],
                              registry=reg)
        self.route_changes = Counter("crucible_route_changes", "Route changes", registry=reg)
        self.aborted = Counter("crucible_steps_aborted", "Steps aborted by a route change", ["replica"], registry=reg)
        self.replacements = Counter("crucible_replacements", "Replacement workers that entered a route",
                                    registry=reg)
        self.ckpts = Counter("crucible_checkpoints", "Checkpoint saves by result", ["result"], registry=reg)
        self.stall = Gauge("crucible_checkpoint_stall_seconds", "Largest snapshot stall of the last committed save",
                           registry=reg)
        self.persist = Gauge("crucible_checkpoint_persist_seconds", "Longest background write of the last save",
                             registry=reg)
        self.ckpt_bytes = Gauge("crucible_checkpoint_bytes", "Size of the last committed checkpoint", registry=reg)
        self.rounds = Counter("crucible_outer_rounds", "Outer rounds closed", ["stage"], registry=reg)
        self.outer_bytes = Counter("crucible_outer_bytes", "Outer-sync payload bytes of the workers", ["direction"],
                                   registry=reg)
        for result in ("committed", "aborted"):
            self.ckpts.labels(result)
        for direction in ("sent", "received"):
            self.outer_bytes.labels(direction)
        reg.register(_StateCollector(coord))
        try:
            self.httpd, self.thread = start_http_server(port, addr=host, registry=reg)
        except OSError as e:
            from crucible.config import ConfigError

            raise ConfigError(f"metrics.prometheus_port: cannot serve /metrics on {host}:{port}: {e}") from None
        self.port = self.httpd.server_port
        adv = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.address = f"{adv}:{self.port}"
        atomic_write(os.path.join(coord.run_dir, "prometheus.addr"), self.address + "\n", fsync=False)
        log.info("prometheus /metrics at http://%s:%d/metrics", host, self.port)

    def observe(self, ev: dict) -> None:
        kind = ev.get("event")
        if kind == "step":
            r = str(ev.get("replica"))
            self.steps.labels(r).inc()
            self.tokens.labels(r).inc(max(0, int(ev.get("tokens", 0) or 0)))
        elif kind == "fault":
            self.faults.labels(str(ev.get("kind", "unknown"))).inc()
        elif kind == "route_change":
            self.route_changes.inc()
        elif kind == "step_aborted":
            self.aborted.labels(str(ev.get("replica"))).inc()
        elif kind == "replacement_ready":
            self.replacements.inc()
        elif kind == "ckpt_commit":
            self.ckpts.labels("committed").inc()
            for gauge, key in ((self.stall, "stall_s"), (self.persist, "persist_s"), (self.ckpt_bytes, "bytes")):
                if isinstance(ev.get(key), (int, float)):
                    gauge.set(ev[key])
        elif kind == "ckpt_abort":
            self.ckpts.labels("aborted").inc()
        elif kind == "outer_round":
            self.rounds.labels(str(ev.get("stage"))).inc()
        elif kind == "outer":
            self.outer_bytes.labels("sent").inc(max(0, int(ev.get("bytes_sent", 0) or 0)))
            self.outer_bytes.labels("received").inc(max(0, int(ev.get("bytes_received", 0) or 0)))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _StateCollector:
    """Gauges read from the coordinator's status at scrape time."""

    def __init__(self, coord):
        self.c = coord

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        st = self.c.status()
        fams = {
            "step": GaugeMetricFamily("crucible_replica_step", "Committed steps of the replica", labels=["replica"]),
            "loss": GaugeMetricFamily("crucible_replica_loss", "Latest training loss", labels=["replica"]),
            "eval_loss": GaugeMetricFamily("crucible_replica_eval_loss", "Latest held-out loss", labels=["replica"]),
            "tokens_per_s": GaugeMetricFamily("crucible_replica_tokens_per_second", "Tokens per second (recent)",
                                              labels=["replica"]),
        }
        goodput = GaugeMetricFamily("crucible_replica_goodput", "Committed compute / wall time (stage 0's ledger)",
                                    labels=["replica"])
        state = GaugeMetricFamily("crucible_replica_state", "1 for the replica's current state",
                                  labels=["replica", "state"])
        for rep in st["replicas"]:
            r = str(rep["id"])
            for key, fam in fams.items():
                v = rep.get(key)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    fam.add_metric([r], float(v))
            g = (rep.get("goodput") or {}).get("goodput")
            if isinstance(g, (int, float)):
                goodput.add_metric([r], float(g))
            for s in membership.STATES:
                state.add_metric([r, s], 1.0 if rep["state"] == s else 0.0)
        workers = GaugeMetricFamily("crucible_workers", "Stage slots by worker state", labels=["state"])
        counts = dict.fromkeys(WORKER_STATES, 0)
        for w in st["workers"]:
            counts[w["state"]] = counts.get(w["state"], 0) + 1
        for s, n in counts.items():
            workers.add_metric([s], n)
        epoch = st["epoch"]
        latest = st["checkpoint"].get("latest_committed_step")
        yield from fams.values()
        yield goodput
        yield state
        yield workers
        yield GaugeMetricFamily("crucible_route_epoch", "Route epoch within this coordinator incarnation",
                                value=epoch & 0xFFFFFFFF)
        yield GaugeMetricFamily("crucible_coordinator_incarnation", "Coordinator incarnation (restarts + 1)",
                                value=epoch >> 32)
        yield GaugeMetricFamily("crucible_checkpoint_latest_step", "Newest committed checkpoint (-1: none)",
                                value=-1 if latest is None else latest)
        yield GaugeMetricFamily("crucible_job_finished", "1 once every replica is done",
                                value=1.0 if st["finished"] else 0.0)
