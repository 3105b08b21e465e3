"""Activation codec specs, ``name[:key=value,key=value...]``, parsed without torch.

``crucible.compress.activations.make_codec`` builds a codec from what
``parse_spec`` returns; ``crucible.config`` runs the same parser when it loads
a configuration (the launcher and the coordinator never import torch), so a
spec the workers would refuse is refused up front, naming its key.
"""

from __future__ import annotations

CODECS = ("none", "bf16", "int8", "int4", "subspace")
COEF_DTYPES = ("bf16", "fp16", "fp32")     # subspace coefficient dtypes
ZSTD_LEVELS = range(-7, 23)
INT4_GROUPS = (2, 1 << 16)                 # int4 group: an even int in this range

_BOOL = {"1": True, "true": True, "yes": True, "on": True,
         "0": False, "false": False, "no": False, "off": False}

_PARAMS = {
    "none": {},
    "bf16": {"level": "int"},
    "int8": {"zstd": "bool", "level": "int"},
    "int4": {"group": "int", "zstd": "bool", "level": "int"},
    "subspace": {"rank": "int", "dtype": "coef"},
}


def check_int4_group(group) -> None:
    lo, hi = INT4_GROUPS
    if not (isinstance(group, int) and not isinstance(group, bool) and lo <= group <= hi and group % 2 == 0):
        raise ValueError(f"int4 group must be an even int in {lo}..{hi}, got {group!r}")


def _parse_value(codec: str, key: str, kind: str, raw: str):
    if kind == "int":
        try:
            v = int(raw, 10)
        except ValueError:
            raise ValueError(f"codec {codec!r}: parameter {key}={raw!r} is not an integer") from None
        if key == "level" and v not in ZSTD_LEVELS:
            raise ValueError(f"codec {codec!r}: zstd level {v} outside {ZSTD_LEVELS.start}..{ZSTD_LEVELS.stop - 1}")
        if codec == "int4" and key == "group":
            check_int4_group(v)
        return v
    if kind == "bool":
        if raw.lower() not in _BOOL:
            raise ValueError(f"codec {codec!r}: parameter {key}={raw!r} is not 0/1/true/false")
        return _BOOL[raw.lower()]
    if raw.lower() not in COEF_DTYPES:
        raise ValueError(f"codec {codec!r}: {key}={raw!r}, valid values: {', '.join(COEF_DTYPES)}")
    return raw.lower()


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"int4:group=64,zstd=1"`` -> ``("int4", {"group": 64, "zstd": True})``.

    Raises ValueError naming an unknown codec or parameter (and the valid
    ones), a value that does not parse, or one out of its range (zstd
    ``level``, int4 ``group``). The subspace ``rank`` depends on ``d_model``:
    the codec checks it."""
    if not isinstance(spec, str):
        raise ValueError(f"codec spec must be a string, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in _PARAMS:
        raise ValueError(f"unknown activation codec {name!r}; valid codecs: {', '.join(CODECS)}")
    allowed = _PARAMS[name]
    params: dict = {}
    for item in (s.strip() for s in rest.split(",")):
        if not item:
            continue
        key, eq, raw = item.partition("=")
        key, raw = key.strip().lower(), raw.strip()
        if key not in allowed:
            valid = ", ".join(allowed) if allowed else "none"
            raise ValueError(f"unknown parameter {key!r} for codec {name!r}; valid parameters: {valid}")
        if not eq or not raw:
            raise ValueError(f"codec {name!r}: parameter {key!r} needs a value ({key}=...)")
        if key in params:
            raise ValueError(f"codec {name!r}: parameter {key!r} given twice")
        params[key] = _parse_value(name, key, allowed[key], raw)
    return name, params
