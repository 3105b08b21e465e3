"""Optional packages: a feature that needs one says so in one line.

The base install trains, checkpoints, serves gRPC health and Prometheus.
``pip install 'crucible[report]'`` adds what the rest needs: matplotlib
(``crucible report``), tensorboard (``metrics.tensorboard = true``) and
safetensors (``crucible export`` / ``crucible sample``).
"""

from __future__ import annotations

import importlib
import importlib.util

from crucible.config import ConfigError

# module -> (pip package, extra)
PACKAGES = {
    "matplotlib": ("matplotlib", "report"),
    "tensorboard": ("tensorboard", "report"),
    "safetensors": ("safetensors", "report"),
    "prometheus_client": ("prometheus-client", ""),
    "grpc_health": ("grpcio-health-checking", ""),
}


class MissingExtra(ConfigError):
    """A feature's optional package is not installed (the message says which and how)."""


def message(module: str, feature: str) -> str:
    package, extra = PACKAGES.get(module, (module, ""))
    how = f"pip install 'crucible[{extra}]'" if extra else f"pip install {package}"
    return f"{feature} needs the {package} package, which is not installed: {how}"


def need(module: str, feature: str):
    """Import ``module`` or raise MissingExtra naming the package and the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(message(module, feature)) from None


def check(module: str, feature: str) -> None:
    """Like ``need`` without importing (cheap: for the launcher, before it starts anything)."""
    if importlib.util.find_spec(module) is None:
        raise MissingExtra(message(module, feature))


def check_config(cfg) -> None:
    """The optional packages the coordinator needs for this configuration."""
    if cfg.metrics.tensorboard:
        check("tensorboard", "metrics.tensorboard = true")
    if cfg.metrics.prometheus_port >= 0:
        check("prometheus_client", "metrics.prometheus_port")
