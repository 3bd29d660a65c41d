"""``docs/configuration.md``, rendered from the declarations in :mod:`range_connector.config.keys`.

``python -m range_connector.config.reference > docs/configuration.md`` writes it; ``tests/unit/test_config_tree.py``
fails when the file and the declarations differ.
"""

from __future__ import annotations

import sys

from range_connector.config.keys import (
    ENGINE_KEYS,
    FLAT_TIER_KEYS,
    SECURITY_KEYS,
    TESTING_KEYS,
    TIER_KEYS,
    Key,
)

_INTRO = """\
# Configuration

Range is configured through vLLM's `--kv-transfer-config`, in `kv_connector_extra_config`: a JSON object of
engine-wide keys and a list of `tiers`. Every key, its unit and its default is below. An unknown key, a value of the
wrong type or out of range, or two settings that contradict each other stop the engine at start-up with a
`ConfigError` whose message starts with the key (`tiers[0].servers: ...`). vLLM prints it among the tracebacks of
its failed start-up, about half a minute after the start: search the log for `ConfigError`.

This file is generated from the declarations in `range_connector/config/keys.py`
(`python -m range_connector.config.reference > docs/configuration.md`); a test fails when they differ.

```json
{"kv_connector": "RangeConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {
   "load_mode": "pipelined",
   "tiers": [{"type": "valkey", "servers": ["valkey://10.0.0.5:6379", "valkey://10.0.0.6:6379"],
              "capacity_bytes": 68719476736}]}}
```
"""


def _table(keys: tuple[Key, ...], *, types: bool = False) -> list[str]:
    head = "| key | unit | default | " + ("tier types | " if types else "") + "meaning |"
    lines = [head, "|" + "---|" * (5 if types else 4)]
    for k in keys:
        kinds = (", ".join(k.types) or "all") + " | " if types else ""
        lines.append(f"| `{k.name}` | {k.unit} | {k.doc_default} | {kinds}{k.description} |")
    return lines


def render() -> str:
    """The whole reference, as Markdown."""
    out = [_INTRO, "## Engine-wide keys", "", *_table(ENGINE_KEYS), "",
           "## Tier keys (`tiers[i]`)", "", *_table(TIER_KEYS, types=True), "",
           "### `tiers[i].security`", ""]
    if SECURITY_KEYS:
        out += [*_table(SECURITY_KEYS), ""]
    else:
        out += ["No keys yet: AUTH and TLS to the tier's servers are not supported yet, and any key here is refused "
                "by name.", ""]
    out += ["### `tiers[i].testing`", "", "Knobs for benchmarks and tests: a latency-injecting wrapper around the "
            "tier. Never needed in production.", "", *_table(TESTING_KEYS), "",
            "## The one-tier shorthand (deprecated)", "",
            "Flat keys of earlier versions still work and describe one tier; each start-up then logs a warning with "
            "the same settings in the new spelling. They cannot be mixed with `tiers`.", "",
            "| flat key | new spelling |", "|---|---|"]
    out += [f"| `{flat}` | `tiers[0].{new}` |" for flat, new in FLAT_TIER_KEYS.items()]
    out += ["", "`memory_capacity_bytes` applied to the memory tier and `shard_capacity_bytes` to the valkey and file "
            "tiers; the one that does not apply to the tier's type is ignored, as before.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
