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
LMCache's and vLLM's offloading settings next to these, with what differs in meaning (per worker or total, bytes or
GiB, tokens or blocks): [settings-compared.md](settings-compared.md).

```json
{"kv_connector": "RangeConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
 "kv_connector_extra_config": {
   "load_mode": "pipelined",
   "tiers": [{"type": "valkey", "servers": ["valkey://10.0.0.5:6379", "valkey://10.0.0.6:6379"],
              "capacity_bytes": 68719476736}]}}
```
"""


_SECURITY_INTRO = """\
Credentials and TLS for a Valkey tier's servers. Every kind of server URL goes through Range's own RESP reader (the
bulk path that reads values straight into KV blocks); valkey-py, which runs the Lua scripts and small commands, gets
the same credentials and TLS settings:

| URL | what it is |
|---|---|
| `valkey://host:port` (or `redis://`) | plain TCP |
| `valkey://user:password@host:port/3` | `AUTH user password` and `SELECT 3` once per connection (`valkey://:password@host` without a user) |
| `valkeys://host:port` (or `rediss://`) | TLS 1.2 or later; the server's certificate must be signed by `tls_ca_file` (else the system's authorities) and name the URL's host (an IP address in the URL needs it as an IP subject alternative name) |
| `unix:///path/to.sock?db=3` | a unix socket (`db`, `username` and `password` are also read as query parameters, on every URL) |

A key set here replaces the URLs' value for every shard (`username` the URL's user, the variable named by
`password_env` the URL's password); what it leaves unset comes from each URL. The password is read from its variable
at start-up and is never logged: every message, log line and error that names a server shows its URL with the
password replaced by `***`. A server that refuses the credentials, or a TLS handshake that fails, stops start-up with
a `ConfigError` naming `tiers[0].servers` and the redacted URL.

```json
{"tiers": [{"type": "valkey", "servers": ["valkeys://range@10.0.0.5:6380/0"],
            "security": {"password_env": "RANGE_VALKEY_PASSWORD", "tls_ca_file": "/etc/range/ca.pem"}}]}
```
"""

_SECURITY_NOTES = """\
What AUTH and TLS cost on the bulk path is measured by `bench/granularity.py --security` (rows `range_valkey_auth`
and `range_valkey_tls` beside `range_valkey`, through a TLS-terminating relay on loopback:
`range_connector/testing/tls_relay.py`). On the 2-core development machine AUTH was within 3% of no AUTH, and TLS
5.6-6.0x slower (0.33 GiB/s, the relay's encryption on the same cores included): a reply is received one TLS record
(16 KiB) at a time, and each record is decrypted by the client ([benchmarks](benchmarks.md#auth-and-tls-on-the-bulk-path---security)).

**A Valkey ACL user for Range.** These are all the commands Range sends, its Lua scripts' commands included (a
script runs with its caller's permissions); every key of a deployment is under its prefix `rc3:<deployment>:` (the
engine-wide key `deployment`, default `default`), so a user can be restricted to one deployment's keys
(`~rc3:<deployment>:*`); here the deployment `default`:

```
ACL SETUSER range on >PASSWORD resetkeys ~rc3:default:* resetchannels -@all +ping +select +client|setinfo +config|get +get +getrange +set +mget +mset +del +exists +type +incr +incrby +decrby +zadd +zcard +zrange +zrem +hset +hgetall +hdel +pexpire +pttl +time +scan +eval +evalsha +script|load +script|exists
```

`+config|get` is optional: without it Range assumes the server's default value limit (`proto-max-bulk-len`, 512 MiB)
and does not check `maxmemory-policy`. A test (`tests/backends/test_valkey_security.py`) runs a whole
write/lookup/read/lease/release/drop cycle as a user created by exactly this line, and checks that the user gets
NOPERM on a key outside its prefix.
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
    out += [_SECURITY_INTRO, *_table(SECURITY_KEYS), "", _SECURITY_NOTES]
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
