"""The file tier's byte budget (C17): byte accounting, least-recently-used eviction and leases, all read from the
shard's directory.

``used`` is the sum over the stripe files in ``stripes/`` (in-flight ``*.tmp`` ones included) of their ``st_size``
less the header page, read from the directory each time (:func:`scan`): it follows the files whatever removed them.
:func:`make_room` evicts least-recently-used (oldest mtime) stripes that hold no live lease, deleting the tickets
still pointing at them before their files, and removes the temp files of writers that died. A lease is an empty file
``leases/<sid>.<expiry ns, wall clock>.<token>``: one listing tells every process the live leases; expired ones are
removed by the next eviction. Eviction runs under the shard's file lock; the tier's layout and guarantees:
:mod:`range_connector.backends.file.backend`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from range_connector.backends.file.stripes import NEW_FILE, PAGE, touch, unlink
from range_connector.backends.file.ticket_log import TicketLog


def scan(root: Path) -> tuple[int, dict[str, tuple[int, int]], list[tuple[Path, int, int]]]:
    """``(used bytes, {sid: (mtime ns, bytes)}, [(temp file, mtime ns, bytes)])``; bytes exclude the header."""
    used, stripes, tmps = 0, {}, []
    for sub in ("stripes", "tickets"):
        with os.scandir(root / sub) as entries:
            for e in entries:
                if sub == "tickets" and not e.name.endswith(".tmp"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = e.stat(follow_symlinks=False)
                    size = max(0, st.st_size - PAGE) if sub == "stripes" else 0
                    used += size
                    if e.name.endswith(".tmp"):
                        tmps.append((Path(e.path), st.st_mtime_ns, size))
                    else:
                        stripes[e.name] = (st.st_mtime_ns, size)
    return used, stripes, tmps


def make_room(root: Path, need: int, capacity_bytes: int, stale_ns: int, log: TicketLog) -> bool:
    """Evict least-recently-used unleased stripes until ``need`` more bytes fit in ``capacity_bytes`` (hold the
    file lock); temp files idle for ``stale_ns`` go first. Whether they fit now."""
    used, stripes, tmps = scan(root)
    if used + need <= capacity_bytes:
        return True
    now = time.time_ns()
    for path, mtime, size in tmps:  # temp files of writers that died
        if now - mtime > stale_ns and unlink(path):
            used -= size
    leased, victims = live_leases(root), []
    for sid in sorted(stripes, key=lambda s: (stripes[s][0], s)):
        if used + need <= capacity_bytes:
            break
        if sid not in leased:
            victims.append(sid)
            used -= stripes[sid][1]
    if victims:
        log.drop_stripes(victims)  # tickets first: a crash here leaves a stripe without tickets, never the reverse
        for sid in victims:
            unlink(root / "stripes" / sid)
    return used + need <= capacity_bytes


def lease_files(root: Path) -> dict[str, list[tuple[int, str]]]:
    """``{sid: [(expiry ns, file name)]}`` of every lease file, earliest expiry first."""
    out: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in os.listdir(root / "leases"):
        parts = name.split(".")
        if len(parts) == 3 and parts[1].isdigit():
            out[parts[0]].append((int(parts[1]), name))
    for held in out.values():
        held.sort()
    return out


def live_leases(root: Path) -> set[str]:
    """The stripes that hold a lease that has not expired; expired lease files are removed on the way."""
    now, live = time.time_ns(), set()
    for sid, held in lease_files(root).items():
        for expiry, name in held:
            if expiry > now:
                live.add(sid)
            else:  # an expired lease protects nothing
                unlink(root / "leases" / name)
    return live


def num_live_leases(root: Path) -> int:
    """Live leases, held by any process."""
    now = time.time_ns()
    return sum(1 for held in lease_files(root).values() for expiry, _ in held if expiry > now)


def take_leases(root: Path, stripe_ids: Sequence[str], expiry_ns: int, token: str) -> None:
    """One lease file per stripe until ``expiry_ns`` (wall clock), and mark each stripe used."""
    for sid in stripe_ids:
        os.close(os.open(root / "leases" / f"{sid}.{expiry_ns}.{token}", NEW_FILE, 0o644))
        touch(root / "stripes" / sid)


def release_leases(root: Path, stripe_ids: Sequence[str], token: str | None) -> None:
    """Remove the lease with ``token`` of each stripe, or without a token the one that expires first."""
    held = lease_files(root) if stripe_ids else {}
    for sid in stripe_ids:
        if token is not None:  # exactly this holder's lease
            for _expiry, name in held.get(sid, ()):
                if name.endswith("." + token):
                    unlink(root / "leases" / name)
            continue
        # the lease that expires first goes; if another process took it, the next one
        while held.get(sid) and not unlink(root / "leases" / held[sid].pop(0)[1]):
            pass
