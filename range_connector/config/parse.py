"""Parsing ``kv_connector_extra_config`` against the declarations in :mod:`range_connector.config.keys`.

Everything here is untrusted input checked once, at start-up, in every vLLM process that builds a connector: an
unknown key, a value of the wrong type or out of range, or two settings that contradict each other raise
:class:`~range_connector.errors.ConfigError` whose key is the path of the offending key as the user wrote it
(``load_deadline_s``, ``tiers[0].servers``, ``tiers[0].testing.delay_s``, or a flat shorthand key), and whose message
names the other key of a contradiction. The result is plain values (``(engine keys, [tier tables])``);
:meth:`range_connector.config.tree.RangeConfig.from_extra_config` builds the frozen tree from them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from range_connector.config.keys import (
    ENGINE_KEYS,
    FLAT_CAPACITY_TYPES,
    FLAT_TIER_KEYS,
    SECURITY_KEYS,
    TESTING_KEYS,
    TIER_KEYS,
    TIER_TYPES,
    Key,
    by_name,
)
from range_connector.config.urls import parse_server_url, redact_url
from range_connector.errors import ConfigError

logger = logging.getLogger("vllm." + __name__)

_ENGINE = by_name(ENGINE_KEYS)
_TIER = by_name(TIER_KEYS)
_TESTING = by_name(TESTING_KEYS)
_SECURITY = by_name(SECURITY_KEYS)


def parse_extra_config(extra: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Check the user's mapping and return its values.

    Args:
        extra: ``kv_connector_extra_config`` (JSON-decoded by vLLM), or ``None``.

    Returns:
        ``(engine, tiers)``: the engine-wide keys that were given, by name (``num_shards`` set from the tier's
        servers when it lists any), and one dict per tier (keys given; ``security`` and ``testing`` as dicts).

    Raises:
        ConfigError: see the module docstring.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError("kv_connector_extra_config", f"{extra!r} is not a JSON object")
    flat = [k for k in extra if k in FLAT_TIER_KEYS]
    for name in extra:
        if name not in _ENGINE and name not in FLAT_TIER_KEYS:
            known = ", ".join([*_ENGINE, *FLAT_TIER_KEYS])
            raise ConfigError(name, f"unknown key (known keys: {known})")
    if "tiers" in extra and flat:
        raise ConfigError(flat[0], f"is the one-tier shorthand of tiers[0].{FLAT_TIER_KEYS[flat[0]]}, and `tiers` is "
                                   "set too: write it inside the tier")
    engine = {name: check_value(_ENGINE[name], value, name) for name, value in extra.items()
              if name in _ENGINE and name != "tiers"}
    if "tiers" in extra:
        tiers = _parse_tiers(extra["tiers"])
        at = next((i for i, t in enumerate(tiers) if t.get("servers")), 0)
        _check_contradictions(engine, tiers[at], f"tiers[{at}].servers")
    else:
        tiers = [_shorthand_tier(extra, flat)]
        _check_contradictions(engine, tiers[0], "valkey_urls")
    return engine, tiers


def check_value(key: Key, value: Any, path: str) -> Any:
    """The value of one scalar key, checked against its declaration (``path``: where it was written).

    Raises:
        ConfigError: the value does not fit (names ``path``).
    """
    kind = key.kind
    if kind == "choice":
        if not isinstance(value, str) or value not in key.choices:
            raise ConfigError(path, f"{value!r} is not one of {', '.join(key.choices)}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(path, f"{value!r} is not true or false")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(path, f"{value!r} is not a string")
        if key.unit == "path" and key.default is None and not value:
            raise ConfigError(path, f"{value!r} is not a path")
        if key.pattern and not re.fullmatch(key.pattern, value):
            raise ConfigError(path, f"{value[:80]!r} does not match {key.pattern}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"{value!r} is not an integer")
        _check_sign(key, value, path)
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            unit = {"s": "seconds", "bytes/s": "bytes per second"}.get(key.unit, key.unit)
            raise ConfigError(path, f"{value!r} is not a number of {unit}")
        _check_sign(key, value, path)
        return float(value)
    if kind == "urls":
        if not isinstance(value, (list, tuple)) or not all(isinstance(u, str) for u in value):
            shown = [redact_url(u) if isinstance(u, str) else u for u in value] if isinstance(value, (list, tuple)) \
                else value  # (never a password: the URLs redacted)
            raise ConfigError(path, f"{shown!r} is not a list of URL strings")
        for url in value:
            check_url(url, path)
        return tuple(value)
    raise AssertionError(f"undeclared kind {kind!r} of {key.name}")  # a declaration error, not user input


def check_url(url: str, path: str) -> None:
    """Raise ``ConfigError(path, ...)`` unless ``url`` is a server URL :func:`~range_connector.config.urls.
    parse_server_url` reads (``valkey://``, ``valkeys://``, ``redis://``, ``rediss://``, ``unix://``, with
    ``user:password@`` and a database); the message shows the URL with its password redacted."""
    try:
        parse_server_url(url)
    except ValueError as exc:
        raise ConfigError(path, str(exc)) from None


def _check_sign(key: Key, value: float, path: str) -> None:
    if value < 0 or (value == 0 and not key.allow_zero):
        raise ConfigError(path, f"{value} must be {'>= 0' if key.allow_zero else '> 0'}")


def _parse_tiers(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError("tiers", f"{value!r} is not a non-empty list of tier tables")
    if len(value) > len(TIER_TYPES):
        raise ConfigError("tiers", f"{len(value)} tiers given: at most {len(TIER_TYPES)}, one of each type "
                                   f"({', '.join(TIER_TYPES)})")
    tiers = [_parse_tier(table, f"tiers[{i}]") for i, table in enumerate(value)]
    seen: dict[str, int] = {}
    for i, tier in enumerate(tiers):
        if tier["type"] in seen:
            raise ConfigError(f"tiers[{i}].type", f"{tier['type']!r} is tiers[{seen[tier['type']]}].type already: "
                                                  "each type at most once")
        seen[tier["type"]] = i
        if tier["type"] == "memory" and i > 0:
            raise ConfigError(f"tiers[{i}].type", "'memory' is the in-process DRAM tier, nearest of all: it can "
                                                  "only be tiers[0]")
    return tiers


def _parse_tier(table: Any, path: str) -> dict[str, Any]:
    if not isinstance(table, Mapping):
        raise ConfigError(path, f"{table!r} is not a table (JSON object)")
    tier_type = check_value(_TIER["type"], table.get("type", _TIER["type"].default), f"{path}.type")
    out: dict[str, Any] = {"type": tier_type}
    for name, value in table.items():
        key = _TIER.get(name)
        if key is None:
            raise ConfigError(f"{path}.{name}", f"unknown key (known keys: {', '.join(_TIER)})")
        if key.types and tier_type not in key.types:
            raise ConfigError(f"{path}.{name}", f"is for {' and '.join(key.types)} tiers, and {path}.type is "
                                                f"{tier_type!r}")
        if name == "security":
            out[name] = _parse_table(value, f"{path}.security", _SECURITY)
            for sub in out[name]:
                if tier_type not in _SECURITY[sub].types:
                    raise ConfigError(f"{path}.security.{sub}", f"is for {' and '.join(_SECURITY[sub].types)} "
                                                                f"tiers, and {path}.type is {tier_type!r}")
        elif name == "testing":
            out[name] = _parse_table(value, f"{path}.testing", _TESTING)
        elif name != "type":
            out[name] = check_value(key, value, f"{path}.{name}")
    if out.get("security"):
        _check_security(out["security"], out.get("servers", ()), path)
    return out


def _check_security(security: dict[str, Any], servers: tuple[str, ...], path: str) -> None:
    """The environment variable and files that ``tiers[i].security`` names exist, and TLS files go with TLS URLs."""
    where = f"{path}.security"
    env = security.get("password_env")
    if env and not os.environ.get(env):
        raise ConfigError(f"{where}.password_env", f"the environment variable {env!r} is not set (or empty)")
    for name in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
        file = security.get(name)
        if file and not os.path.isfile(os.path.expanduser(file)):
            raise ConfigError(f"{where}.{name}", f"{file!r} is not a readable file")
    if security.get("tls_key_file") and not security.get("tls_cert_file"):
        raise ConfigError(f"{where}.tls_key_file", f"is the key of a client certificate, and {where}.tls_cert_file "
                                                   "is not set")
    tls_keys = [k for k in ("tls_ca_file", "tls_cert_file", "tls_key_file") if security.get(k)]
    if tls_keys and not any(parse_server_url(u).tls for u in servers):
        shown = ", ".join(redact_url(u) for u in servers) or "none: embedded servers, which have no TLS"
        raise ConfigError(f"{where}.{tls_keys[0]}", f"applies to valkeys:// servers, and {path}.servers lists "
                                                    f"{shown}")


def _parse_table(value: Any, path: str, keys: dict[str, Key], unknown_why: str = "") -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"{value!r} is not a table (JSON object)")
    out = {}
    for name, item in value.items():
        if name not in keys:
            raise ConfigError(f"{path}.{name}", unknown_why or f"unknown key (known keys: {', '.join(keys)})")
        out[name] = check_value(keys[name], item, f"{path}.{name}")
    return out


def _shorthand_tier(extra: Mapping[str, Any], flat: list[str]) -> dict[str, Any]:
    """The one tier that flat keys describe, checked under their flat names; warns with the new spelling."""
    tier_type = check_value(_TIER["type"], extra.get("backend", _TIER["type"].default), "backend")
    tier: dict[str, Any] = {"type": tier_type}
    ignored = []
    for name in flat:
        if name == "backend":
            continue
        target = FLAT_TIER_KEYS[name]
        value = extra[name]
        if name == "valkey_urls" and isinstance(value, str):
            logger.warning("Range config: valkey_urls is a string; it is taken as a list of one URL. Write a list: "
                           "[%s]", json.dumps(redact_url(value)))
            value = [value]
        key = _TESTING[target.split(".")[1]] if target.startswith("testing.") else _TIER[target]
        checked = check_value(key, value, name)  # (checked even where it does not apply, as before)
        applies = tier_type in FLAT_CAPACITY_TYPES.get(name, key.types or (tier_type,))
        if not applies and checked and target in ("servers", "directory"):
            raise ConfigError(name, f"is for backend {' and '.join(map(repr, key.types))}, and backend is "
                                    f"{tier_type!r}")
        if not applies:
            ignored.append(name)  # (as before: a key of another tier type has no effect)
        elif target.startswith("testing."):
            tier.setdefault("testing", {})[key.name] = checked
        else:
            tier[target] = checked
    if flat:
        _warn_flat(flat, tier, ignored)
    return tier


def _warn_flat(flat: list[str], tier: dict[str, Any], ignored: list[str]) -> None:
    shown = {k: [redact_url(u) for u in v] if k == "servers" else list(v) if isinstance(v, tuple) else v
             for k, v in tier.items()}
    spelled = json.dumps({"tiers": [shown]})
    renames = ", ".join(f"{k} -> tiers[0].{FLAT_TIER_KEYS[k]}" for k in flat)
    message = (f"Range config: the flat keys {', '.join(flat)} are the deprecated one-tier shorthand; write "
               f"{spelled} instead ({renames})")
    if ignored:
        message += f"; {', '.join(ignored)} does not apply to a {tier['type']!r} tier and is ignored"
    logger.warning(message)
    warnings.warn(message, DeprecationWarning, stacklevel=4)


def _check_contradictions(engine: dict[str, Any], tier: dict[str, Any], servers_key: str) -> None:
    low, high = engine.get("min_load_deadline_s"), engine.get("load_deadline_s")
    low = _ENGINE["min_load_deadline_s"].default if low is None else low
    high = _ENGINE["load_deadline_s"].default if high is None else high
    if low > high:
        raise ConfigError("min_load_deadline_s", f"{low} is above load_deadline_s = {high}: the shortest deadline "
                                                 "cannot exceed the longest")
    servers = tier.get("servers", ())
    if servers:
        if "num_shards" in engine and engine["num_shards"] != len(servers):
            raise ConfigError("num_shards", f"{engine['num_shards']} does not match the {len(servers)} entries of "
                                            f"{servers_key}")
        engine["num_shards"] = len(servers)


def with_tier_settings(extra: Mapping[str, Any], **settings: Any) -> dict[str, Any]:
    """``extra`` with the one tier's ``settings`` (tree names: ``servers``, ``directory``...) added, in the spelling
    ``extra`` already uses: into ``tiers[0]`` for the tree (a new tier table when ``extra`` has none), as the flat
    keys for the shorthand. For tools that add servers or a directory to a user's config (demo, replay,
    calibration); a key the user set wins.

    Raises:
        ConfigError: ``settings`` names a key that has no flat spelling while ``extra`` uses the shorthand.
    """
    out = dict(extra)
    if any(k in FLAT_TIER_KEYS for k in out):
        flat_of = {target: flat for flat, target in FLAT_TIER_KEYS.items() if flat not in FLAT_CAPACITY_TYPES}
        for name, value in settings.items():
            if name not in flat_of:
                raise ConfigError(name, "has no flat spelling; write the config as `tiers`")
            out.setdefault(flat_of[name], list(value) if isinstance(value, tuple) else value)
        return out
    tiers = [dict(t) for t in out.get("tiers") or [{}]]
    for name, value in settings.items():
        tiers[0].setdefault(name, list(value) if isinstance(value, tuple) else value)
    out["tiers"] = tiers
    return out
