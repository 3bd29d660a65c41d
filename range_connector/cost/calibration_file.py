"""The calibration file written by ``range-connector calibrate`` and read by the gate, and the fits behind it.

Schema ``range-connector-calibration``, version 1 (JSON)::

    {"schema": "range-connector-calibration", "version": 1, "created_unix_s": 1.7e9,
     "model": "/path/or/url", "bytes_per_token": 131072,
     "prefill": {"linear_s_per_token": 2e-5, "attention_s_per_token2": 1e-9, "overhead_s": 0.02,
                 "points": [[tokens, seconds], ...]},
     "tiers": {"valkey": [{"bandwidth_bytes_per_s": 2.5e9, "t0_s": 0.001, "points": [[bytes, seconds], ...]},
                          ...one entry per shard]}}

``prefill`` may be ``null`` (not measured) and ``tiers`` empty. Unknown keys, another schema or version, and values
out of range are :class:`~range_connector.errors.ConfigError` naming ``<path>:<field>``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from range_connector.cost.model import PrefillRate, TierEstimate
from range_connector.errors import ConfigError

__all__ = ["CALIBRATION_SCHEMA", "CALIBRATION_VERSION", "Calibration", "fit_prefill_rate", "fit_tier_line",
           "load_calibration", "write_calibration"]

CALIBRATION_SCHEMA = "range-connector-calibration"
CALIBRATION_VERSION = 1


@dataclass(frozen=True, slots=True)
class Calibration:
    """What ``range-connector calibrate`` measured (file schema ``range-connector-calibration``, version 1).

    Attributes:
        prefill: the fitted prefill curve; ``None`` when not measured.
        prefill_overhead_s: fixed seconds per request that the prefill fit removed (client, HTTP, first decode).
        tiers: ``{backend: [num_shards] TierEstimate}``.
        bytes_per_token: ``s`` of the measured model (all layers), bytes; ``None`` when unknown.
        model: what was measured (model directory or URL).
        created_unix_s: when.
        prefill_points: ``[(prompt tokens, seconds)]`` measured.
        tier_points: ``{backend: [num_shards] [(bytes, seconds)]}`` measured.
    """

    prefill: PrefillRate | None = None
    prefill_overhead_s: float = 0.0
    tiers: Mapping[str, tuple[TierEstimate, ...]] = field(default_factory=dict)
    bytes_per_token: float | None = None
    model: str | None = None
    created_unix_s: float = 0.0
    prefill_points: tuple[tuple[int, float], ...] = ()
    tier_points: Mapping[str, tuple[tuple[tuple[int, float], ...], ...]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The file's JSON document."""
        prefill = None
        if self.prefill is not None:
            prefill = {"linear_s_per_token": self.prefill.linear_s_per_token,
                       "attention_s_per_token2": self.prefill.attention_s_per_token2,
                       "overhead_s": self.prefill_overhead_s, "points": [list(p) for p in self.prefill_points]}
        tiers = {
            name: [{"bandwidth_bytes_per_s": e.bandwidth_bytes_per_s, "t0_s": e.t0_s,
                    "points": [list(p) for p in (self.tier_points.get(name, ()) or ((),) * len(shards))[i]]}
                   for i, e in enumerate(shards)]
            for name, shards in self.tiers.items()
        }
        return {"schema": CALIBRATION_SCHEMA, "version": CALIBRATION_VERSION, "created_unix_s": self.created_unix_s,
                "model": self.model, "bytes_per_token": self.bytes_per_token, "prefill": prefill, "tiers": tiers}


def write_calibration(calibration: Calibration, path: str | os.PathLike[str]) -> Path:
    """Write the file atomically (a temporary file renamed into place). Returns the path. Raises OSError."""
    target = Path(path).expanduser()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(calibration.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read a calibration file.

    Raises:
        ConfigError: the file is missing, not JSON, of another schema or version, or a value is missing or out of
            range; the key is ``<path>:<field>`` (e.g. ``cal.json:tiers.valkey[0].t0_s``).
    """
    where = str(path)

    def bad(key: str, message: str) -> ConfigError:
        return ConfigError(f"{where}:{key}" if key else where, message)

    try:
        doc = json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise bad("", f"cannot read the calibration file ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise bad("", f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise bad("", "not a JSON object")
    if doc.get("schema") != CALIBRATION_SCHEMA:
        raise bad("schema", f"{doc.get('schema')!r} is not {CALIBRATION_SCHEMA!r}")
    if doc.get("version") != CALIBRATION_VERSION:
        raise bad("version", f"{doc.get('version')!r} is not supported (this build reads {CALIBRATION_VERSION})")
    known = {"schema", "version", "created_unix_s", "model", "bytes_per_token", "prefill", "tiers"}
    if unknown := sorted(set(doc) - known):
        raise bad(unknown[0], "unknown key")

    def number(obj: Mapping[str, Any], key: str, at: str, *, positive: bool = False) -> float:
        v = obj.get(key) if isinstance(obj, Mapping) else None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (
                positive and v == 0):
            raise bad(f"{at}{key}", f"{v!r} is not a {'positive' if positive else 'non-negative'} finite number")
        return float(v)

    def points(obj: Mapping[str, Any], at: str) -> tuple[tuple[int, float], ...]:
        raw = obj.get("points", [])
        ok = isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in p)
            for p in raw)
        if not ok:
            raise bad(f"{at}points", "not a list of [size, seconds] pairs of non-negative numbers")
        return tuple((int(p[0]), float(p[1])) for p in raw)

    prefill, overhead, prefill_points = None, 0.0, ()
    if doc.get("prefill") is not None:
        p = doc["prefill"]
        if not isinstance(p, dict):
            raise bad("prefill", "not a JSON object")
        prefill = PrefillRate(number(p, "linear_s_per_token", "prefill.", positive=True),
                              number(p, "attention_s_per_token2", "prefill."))
        overhead, prefill_points = number(p, "overhead_s", "prefill."), points(p, "prefill.")
    tiers: dict[str, tuple[TierEstimate, ...]] = {}
    tier_points: dict[str, tuple[tuple[tuple[int, float], ...], ...]] = {}
    raw_tiers = doc.get("tiers", {})
    if not isinstance(raw_tiers, dict):
        raise bad("tiers", "not a JSON object of backend -> list of shards")
    for name, shards in raw_tiers.items():
        if not isinstance(shards, list) or not shards:
            raise bad(f"tiers.{name}", "not a non-empty list of shard measurements")
        tiers[name] = tuple(TierEstimate(number(s, "bandwidth_bytes_per_s", f"tiers.{name}[{i}].", positive=True),
                                         number(s, "t0_s", f"tiers.{name}[{i}]."))
                            for i, s in enumerate(shards))
        tier_points[name] = tuple(points(s, f"tiers.{name}[{i}].") for i, s in enumerate(shards))
    bpt = doc.get("bytes_per_token")
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"{model!r} is not a string")
    return Calibration(prefill, overhead, tiers,
                       None if bpt is None else number(doc, "bytes_per_token", "", positive=True), model,
                       number(doc, "created_unix_s", "") if "created_unix_s" in doc else 0.0, prefill_points,
                       tier_points)


def _nonnegative_fit(columns: dict[str, np.ndarray], y: np.ndarray, required: str) -> dict[str, float]:
    """Least squares with non-negative coefficients over a few columns (``required`` > 0).

    Every subset of columns that contains ``required`` is solved with ``numpy.linalg.lstsq``; the feasible solution
    with the smallest residual wins, the smaller subset on ties. Exact for two or three columns.

    Raises:
        ValueError: no subset gives ``required`` > 0 with the others >= 0.
    """
    best: tuple[float, dict[str, float]] | None = None
    others = [k for k in columns if k != required]
    for k in range(len(others) + 1):
        for subset in itertools.combinations(others, k):
            names = [required, *subset]
            a = np.stack([columns[name] for name in names], axis=1)
            coef = np.linalg.lstsq(a, y, rcond=None)[0]
            if coef[0] <= 0 or np.any(coef < 0):
                continue
            residual = float(np.sum((a @ coef - y) ** 2))
            if best is None or residual < best[0] * (1 - 1e-9) - 1e-18:
                best = (residual, dict(zip(names, map(float, coef))))
    if best is None:
        raise ValueError(f"points: the measured times do not grow with {required} (no positive fit)")
    return {name: best[1].get(name, 0.0) for name in columns}


def _points(name: str, points: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    arr = np.asarray(points, dtype=float)
    if arr.ndim != 2 or arr.shape[1] != 2 or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name}: expected [num_points, 2] finite non-negative (size, seconds) pairs")
    sizes = np.unique(arr[:, 0])
    if len(sizes) < 2:
        raise ValueError(f"{name}: need at least two different sizes to fit a line")
    if arr[arr[:, 0] == sizes[-1], 1].mean() <= arr[arr[:, 0] == sizes[0], 1].mean():
        raise ValueError(f"{name}: the largest size took no longer than the smallest (times do not grow with size)")
    return arr[:, 0], arr[:, 1]


def fit_prefill_rate(points: Sequence[tuple[int, float]]) -> tuple[PrefillRate, float]:
    """Fit ``seconds = overhead + c1·n + c2·n²/2`` to measured prefills of ``n``-token prompts.

    ``overhead`` is the fixed per-request cost (HTTP, scheduling, the first decode step) that a client-measured
    TTFT includes and the cost model must not; it is fitted and returned apart. Coefficients are non-negative
    (``c1`` > 0); see :func:`_nonnegative_fit`.

    Args:
        points: ``[num_points]`` of ``(prompt tokens, seconds)``, at least two different lengths.

    Returns:
        ``(PrefillRate(c1, c2), overhead_s)``.

    Raises:
        ValueError: malformed points, a single length, or times that do not grow with length.
    """
    n, y = _points("points", points)
    fit = _nonnegative_fit({"c1": n, "c0": np.ones_like(n), "c2": n * n / 2.0}, y, "c1")
    return PrefillRate(fit["c1"], fit["c2"]), fit["c0"]


def fit_tier_line(points: Sequence[tuple[int, float]]) -> TierEstimate:
    """Fit ``seconds = T0 + bytes/B`` to timed reads (non-negative ``T0``, positive ``1/B``).

    Args:
        points: ``[num_points]`` of ``(bytes, seconds)``, at least two different sizes.

    Raises:
        ValueError: malformed points, a single size, or times that do not grow with size.
    """
    x, y = _points("points", points)
    fit = _nonnegative_fit({"s_per_byte": x, "t0": np.ones_like(x)}, y, "s_per_byte")
    return TierEstimate(1.0 / fit["s_per_byte"], fit["t0"])
