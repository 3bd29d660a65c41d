"""Typed exceptions of the Range connector.

Every error names what went wrong in terms a user can act on: the config key, the tier and shard, the key and
the byte range. Failures while serving never escape to vLLM as exceptions from a hook: the worker turns them into
load errors (vLLM recomputes) and the scheduler into misses.
"""

from __future__ import annotations


class RangeError(Exception):
    """Base class of every error raised by the Range connector."""


class ConfigError(RangeError, ValueError):
    """A value in ``kv_connector_extra_config`` (or derived from vLLM's config) is unusable.

    The message starts with the offending key, e.g. ``chunk_tokens: 100 is not a multiple of block_size 128``.
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class BackendError(RangeError):
    """A storage tier failed (connection refused, protocol error, bad reply)."""


class BackendTimeoutError(BackendError, TimeoutError):
    """A storage tier did not answer within its deadline."""


class ServerStartError(BackendError):
    """An embedded Valkey server could not be started or did not answer in time."""


class IntegrityError(RangeError):
    """Bytes read from a tier do not match what was saved (size, header or checksum mismatch)."""


class PatchMismatchError(RangeError):
    """The installed vLLM file that the engine patch targets is neither the pinned version nor its patched form.

    The message names the file, the vLLM version found and the expected one; nothing is written.
    """


class CollectiveError(RangeError):
    """A collective over the context-parallel group failed or did not complete within its timeout (a rank died,
    stopped, or issued a different sequence of collectives)."""


class TraceError(RangeError, ValueError):
    """A request trace is unusable: a bad field, line or option.

    The message is one line naming the file, the line and the field, e.g.
    ``trace.jsonl:12: input_length: -5 is not a positive integer``.
    """


class ResultFileError(RangeError, ValueError):
    """A benchmark, replay or demo result file cannot be reported on: unreadable, not JSON, or not a shape that
    ``range-connector report`` knows.

    The message is one line that starts with the file, e.g. ``run.json: not JSON (line 3, column 1: ...)``.
    """
