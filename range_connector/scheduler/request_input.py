"""What Range reads from a request, parsed once into a typed, bounded :class:`RequestInput`.

Everything here is client input: ``kv_transfer_params`` (any client of ``/v1/completions`` can send it, and vLLM
passes it through as a plain dict), the ``cache_salt`` and the media identities (``mm_features[i].identifier``) that
go into the prefix hash's first link, and the LoRA adapter's name. The parser never raises: a part that is not the
expected type or is over its bound is dropped and counted by kind (:data:`REJECTION_KINDS`, on ``/metrics`` as
``vllm:range_rejected_request_inputs_total{kind=...}``) and logged once per kind per process.

What a dropped part costs, by kind:

* an announcement part (``range``, ``num_tokens``, ``settings``, ``chain_head``, ``version``): the request is treated
  as carrying no announcement (a decode engine looks up and loads what it finds; it does not wait);
* ``range_expect``: the producer does not compare the consumer's settings (it answers as usual);
* ``do_remote_decode`` / ``range_describe`` that are not booleans: not asked (no announcement in the answer);
* ``cache_salt``, ``media_ids`` or ``lora_name`` over their bounds (or of the wrong type): Range leaves the request
  alone (no lookup, no save), since hashing it without them could share KV across salts. vLLM recomputes it.

Bounds are on what is read, not on the whole dict: other connectors' keys in ``kv_transfer_params`` are not walked.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm." + __name__)

#: the largest ``num_tokens`` an announcement may carry (larger: no announcement)
MAX_ANNOUNCED_TOKENS = 1 << 40
#: settings a producer or a consumer may name (more: the part is dropped)
MAX_SETTINGS = 64
#: characters of one setting's name
MAX_SETTING_NAME_CHARS = 128
#: characters of one setting's text value (a namespace fingerprint is 64)
MAX_SETTING_TEXT_CHARS = 4096
#: characters of ``chain_head`` (a hex prefix hash; 64 today)
MAX_CHAIN_HEAD_CHARS = 256
#: characters of ``cache_salt`` and of the LoRA name
MAX_SALT_CHARS = 4096
#: media items of one prompt, and characters of one media identity
MAX_MEDIA_ITEMS = 4096
MAX_MEDIA_ID_CHARS = 1024

#: every kind of dropped input, in the order of the reference (docs/security.md); the ``kind`` label's values
REJECTION_KINDS: tuple[str, ...] = ("kv_transfer_params", "do_remote_decode", "range_describe", "range",
                                    "version", "num_tokens", "settings", "chain_head", "range_expect", "cache_salt",
                                    "media_ids", "lora_name")
#: the stats key of each kind (scheduler counters, summed into RangeConnectorStats)
REJECTION_STATS: dict[str, str] = {kind: f"rejected_input_{kind}" for kind in REJECTION_KINDS}

Setting = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class Announcement:
    """What a producer announced for this request (``kv_transfer_params["range"]``).

    Attributes:
        num_tokens: prompt tokens the producer stored, in ``[0, MAX_ANNOUNCED_TOKENS]``.
        settings: the producer's settings by name (scalars only; at most :data:`MAX_SETTINGS`; ``namespace`` among
            them).
        chain_head: hex prefix hash of the last stored chunk, or ``None``.
    """

    num_tokens: int
    settings: Mapping[str, Setting]
    chain_head: str | None


@dataclass(frozen=True, slots=True)
class RequestInput:
    """One request's client input as Range uses it.

    Attributes:
        do_remote_decode: a disaggregated proxy asked this (prefill) engine to announce what it stored.
        describe: the proxy's settings probe (``range_describe``): answer with this engine's settings.
        announcement: what a producer announced, or ``None`` (none, or dropped).
        expect: the consumer's settings, sent with ``do_remote_decode`` (``range_expect``), or ``None``.
        salt: the bytes of the prefix hash's first link (:func:`range_connector.kv.namespace.request_salt`'s inputs,
            bounded); ``None`` when a salt part was dropped: Range then leaves the request alone.
        rejected: the kinds dropped (:data:`REJECTION_KINDS`), in the order found.
    """

    do_remote_decode: bool = False
    describe: bool = False
    announcement: Announcement | None = None
    expect: Mapping[str, Setting] | None = None
    salt: tuple[str | None, str | None, tuple[str, ...]] | None = (None, None, ())
    rejected: tuple[str, ...] = ()

    @property
    def wants_announcement(self) -> bool:
        """The request asked for ``kv_transfer_params`` in its answer."""
        return self.do_remote_decode or self.describe


def _flag(params: Mapping[str, Any], key: str, rejected: list[str]) -> bool:
    value = params.get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    rejected.append(key)
    return False


def _settings(value: Any) -> dict[str, Setting] | None:
    """A settings table of scalars within bounds, or ``None``."""
    if not isinstance(value, Mapping) or len(value) > MAX_SETTINGS:
        return None
    out: dict[str, Setting] = {}
    for name, item in value.items():
        if not isinstance(name, str) or len(name) > MAX_SETTING_NAME_CHARS:
            return None
        if isinstance(item, str):
            if len(item) > MAX_SETTING_TEXT_CHARS:
                return None
        elif isinstance(item, float):
            if not math.isfinite(item):
                return None
        elif item is not None and not isinstance(item, int):  # (bool is an int)
            return None
        out[name] = item
    return out


def _announcement(info: Any, rejected: list[str]) -> Announcement | None:
    if info is None:
        return None
    if not isinstance(info, Mapping):
        rejected.append("range")
        return None
    version = info.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version != 1:
        rejected.append("version")
        return None
    if "num_tokens" not in info:  # (settings alone announce nothing)
        return None
    num_tokens = info["num_tokens"]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 0 <= num_tokens <= MAX_ANNOUNCED_TOKENS:
        rejected.append("num_tokens")
        return None
    settings = _settings(info.get("settings"))
    if settings is None or not isinstance(settings.get("namespace"), str):  # a producer always names its namespace
        rejected.append("settings")
        return None
    head = info.get("chain_head")
    if head is not None and (not isinstance(head, str) or len(head) > MAX_CHAIN_HEAD_CHARS):
        rejected.append("chain_head")
        return None
    return Announcement(num_tokens, settings, head)


def _salt(lora_name: Any, cache_salt: Any, media_ids: Sequence[Any],
          rejected: list[str]) -> tuple[str | None, str | None, tuple[str, ...]] | None:
    ok = True
    if lora_name is not None and (not isinstance(lora_name, str) or len(lora_name) > MAX_SALT_CHARS):
        rejected.append("lora_name")
        ok = False
    if cache_salt is not None and (not isinstance(cache_salt, str) or len(cache_salt) > MAX_SALT_CHARS):
        rejected.append("cache_salt")
        ok = False
    if len(media_ids) > MAX_MEDIA_ITEMS or not all(
            isinstance(m, str) and len(m) <= MAX_MEDIA_ID_CHARS for m in media_ids):
        rejected.append("media_ids")
        ok = False
    return (lora_name, cache_salt, tuple(media_ids)) if ok else None


def parse_request_input(kv_transfer_params: Any, *, cache_salt: Any = None, media_ids: Sequence[Any] = (),
                        lora_name: Any = None) -> RequestInput:
    """Parse one request's client input; never raises.

    Args:
        kv_transfer_params: the request's ``kv_transfer_params`` (any value: only a mapping is read, and in it only
            ``do_remote_decode``, ``range_describe``, ``range_expect`` and ``range``).
        cache_salt: vLLM's ``cache_salt`` (a str, or ``None``).
        media_ids: ``[num_media_items]`` media identities in prompt order.
        lora_name: the LoRA adapter's name, or ``None``.

    Returns:
        The typed input; :attr:`RequestInput.rejected` names what was dropped.
    """
    rejected: list[str] = []
    salt = _salt(lora_name, cache_salt, media_ids, rejected)
    if kv_transfer_params is None:
        return RequestInput(salt=salt, rejected=tuple(rejected))
    if not isinstance(kv_transfer_params, Mapping):
        rejected.append("kv_transfer_params")
        return RequestInput(salt=salt, rejected=tuple(rejected))
    do_remote_decode = _flag(kv_transfer_params, "do_remote_decode", rejected)
    describe = _flag(kv_transfer_params, "range_describe", rejected)
    expect = None
    if kv_transfer_params.get("range_expect") is not None:
        expect = _settings(kv_transfer_params["range_expect"])
        if expect is None:
            rejected.append("range_expect")
    announcement = _announcement(kv_transfer_params.get("range"), rejected)
    return RequestInput(do_remote_decode, describe, announcement, expect, salt, tuple(rejected))


def request_input_of(request: Any) -> RequestInput:
    """:func:`parse_request_input` of a vLLM ``Request`` (``kv_transfer_params``, ``cache_salt``,
    ``mm_features[i].identifier``, ``lora_request.lora_name``); never raises."""
    try:
        lora = getattr(request, "lora_request", None)
        features = getattr(request, "mm_features", None) or ()
        if not isinstance(features, Sequence) or len(features) > MAX_MEDIA_ITEMS:
            media: Sequence[Any] = [None]  # counted as media_ids
        else:
            media = [getattr(f, "identifier", None) for f in features]
        return parse_request_input(getattr(request, "kv_transfer_params", None),
                                   cache_salt=getattr(request, "cache_salt", None), media_ids=media,
                                   lora_name=getattr(lora, "lora_name", None) if lora is not None else None)
    except Exception as exc:  # noqa: BLE001 (an attribute that raises: still no exception in the engine loop)
        logger.warning("Range: could not read request %s (%s: %s); Range leaves it alone",
                       getattr(request, "request_id", "?"), type(exc).__name__, exc)
        return RequestInput(salt=None, rejected=("kv_transfer_params",))


class RequestInputs:
    """The parsed input of every request the scheduler follows (parsed once per request), with the rejection
    counters and the once-per-kind log.

    Args:
        stats: the scheduler's counters; :data:`REJECTION_STATS` are counted here, once per request and kind.
    """

    def __init__(self, stats: MutableMapping[str, int]) -> None:
        self.stats = stats
        for key in REJECTION_STATS.values():
            stats.setdefault(key, 0)
        self._inputs: dict[str, RequestInput] = {}
        self._logged: set[str] = set()

    def get(self, request: Any) -> RequestInput:
        """The request's parsed input (parsed, counted and logged at the first call for its ``request_id``)."""
        req_id = getattr(request, "request_id", None)
        parsed = self._inputs.get(req_id) if isinstance(req_id, str) else None
        if parsed is not None:
            return parsed
        parsed = request_input_of(request)
        if isinstance(req_id, str):
            self._inputs[req_id] = parsed
        for kind in dict.fromkeys(parsed.rejected):
            self.stats[REJECTION_STATS[kind]] += 1
            if kind not in self._logged:
                self._logged.add(kind)
                logger.warning("Range: request %s: ignored its %s (not of the expected type, or over its bound: "
                               "docs/security.md); further requests with this kind of input are only counted "
                               "(vllm:range_rejected_request_inputs_total{kind=\"%s\"})", req_id, kind, kind)
        return parsed

    def forget(self, req_id: str) -> None:
        """The request ended."""
        self._inputs.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._inputs)
