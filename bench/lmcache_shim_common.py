"""What both sides of ``bench/lmcache_shim.py`` use: units, the per-path summary, Valkey server counts, small helpers.

Standard library only at module level (torch and valkey are imported where they are used, in the LMCache
environment). :func:`_aggregate` turns a path's per-repeat records into its medians (the parent merges the repeats of
retried children with it, the child updates its partial report); :class:`_ValkeyStats` counts a server's commands
(``INFO commandstats``) and deletes the keys a run left; :class:`_Unsupported` is raised by a path that cannot run
with the given layout and is reported as ``unsupported``; :func:`_run_with_timeout` bounds a call that can hang.
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

GIB = 1 << 30
MIB = 1 << 20


TIMING_NOTES = (
    "restore_s: load request -> every layer's bytes in the destination blocks (includes LMCache's own work, the "
    "shim's staging cat/stack and one index_copy_ per layer, see shim_copy_s); lookup_s is timed separately, before "
    "it; verify_s (exact byte comparison of every destination block with its source) is NOT included in restore_s; "
    "first_layer_s equals restore_s for paths that deliver all layers at once"
)


def _aggregate(per_repeat: list[dict[str, Any]], payload_bytes: int) -> dict[str, Any]:
    """Medians and the rest of the summary from the per-repeat records."""

    def col(name: str) -> list[float]:
        return [r[name] for r in per_repeat]

    med = _median(col("restore_s"))
    last = per_repeat[-1] if per_repeat else {}
    return {
        "restore_s_all": col("restore_s"),
        "restore_s_median": med,
        "gib_per_s": payload_bytes / GIB / med if med else None,
        "first_layer_s_all": col("first_layer_s"),
        "first_layer_s_median": _median(col("first_layer_s")),
        "lookup_s_all": col("lookup_s"),
        "lookup_s_median": _median(col("lookup_s")),
        "shim_copy_s_median": _median(col("shim_copy_s")),
        "verify_s_median": _median(col("verify_s")),
        "repeats_done": len(per_repeat),
        "client_counts_restore": last.get("client"),
        # (the split of the restore, e.g. LMCache's L1 allocation and the adapter's load task, per repeat: medians)
        "client_s_medians": {k: _median([r["client"][k] for r in per_repeat if isinstance(r.get("client", {}).get(k),
                                                                                         float)])
                             for k in sorted({k for r in per_repeat for k in (r.get("client") or {})
                                              if k.endswith("_s")})},
        "server_commands_restore": last.get("server_commands_restore"),
        "server_commands_lookup": last.get("server_commands_lookup"),
        "timing_notes": TIMING_NOTES,
    }


class _Unsupported(Exception):
    pass


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


class _ValkeyStats:
    """Server-side command counts (INFO commandstats) of one server, as deltas between snapshots."""

    def __init__(self, url: str) -> None:
        import valkey

        host, port = _host_port(url)
        self.client = valkey.Valkey(host=host, port=port, socket_timeout=30)

    def snapshot(self) -> dict[str, int]:
        raw = self.client.info("commandstats")
        return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}

    @staticmethod
    def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        out = {}
        for k, v in after.items():
            d = v - before.get(k, 0)
            if d and k not in ("info",):
                out[k] = d
        return out

    def delete_matching(self, pattern: str) -> int:
        n = 0
        batch = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                n += self.client.unlink(*batch)
                batch = []
        if batch:
            n += self.client.unlink(*batch)
        return n


def _host_port(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return host or "127.0.0.1", int(port)


def _int64_flat(t):
    import torch

    return t.reshape(-1).view(torch.int64)


def _run_with_timeout(fn, timeout_s: float) -> str:
    """Run fn in a daemon thread; return 'ok', 'error: ...' or 'timeout' (LMCache's close can hang)."""
    box: dict[str, str] = {}

    def target() -> None:
        try:
            fn()
            box["r"] = "ok"
        except Exception as exc:
            box["r"] = f"error: {type(exc).__name__}: {exc}"

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    return box.get("r", f"timeout after {timeout_s} s")
