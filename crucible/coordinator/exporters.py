"""What the coordinator exports besides metrics.jsonl, as configured (``metrics.*``).

Each exporter has ``observe(event)`` (called for every event the coordinator
writes to metrics.jsonl, under its lock: it must be quick and never block)
and ``close()``; ``start`` returns the ones the configuration asks for.
"""

from __future__ import annotations

import logging

log = logging.getLogger("crucible.exporters")


def start(coord, host: str) -> list:
    """TensorBoard event files (``metrics.tensorboard``) and Prometheus
    ``/metrics`` (``metrics.prometheus_port`` >= 0, on ``host``)."""
    cfg = coord.cfg.metrics
    out = []
    if cfg.tensorboard:
        from crucible.coordinator.tensorboard_sink import TensorBoardSink

        out.append(TensorBoardSink(coord.run_dir, coord.write_failures))    # (a full disk: said as the others)
    if cfg.prometheus_port >= 0:
        from crucible.coordinator.prometheus import PrometheusExporter

        prom = PrometheusExporter(coord, host, cfg.prometheus_port)
        out.append(prom)
        coord.metrics.write({"event": "prometheus", "address": prom.address, "path": "/metrics"})
    return out


def observe(exporters: list, event: dict) -> None:
    for ex in exporters:
        try:
            ex.observe(event)
        except Exception:   # an exporter's bug must never break the coordinator
            log.exception("%s could not take event %s", type(ex).__name__, event.get("event"))


def close(exporters: list) -> None:
    for ex in exporters:
        try:
            ex.close()
        except Exception:
            log.exception("closing %s", type(ex).__name__)
