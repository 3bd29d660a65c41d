"""``range-connector cache stats|clear|lookup``: what the tiers hold, removing a deployment's entries, and the hit a
prompt would get, all without an engine.

Every sub-command reads the connector config from ``--config FILE`` (the JSON that ``kv_connector_extra_config``
takes, or a whole ``--kv-transfer-config`` document holding one; without it the defaults: one Valkey tier on
embedded servers); ``--runtime-dir`` sets its ``runtime_dir`` (where embedded servers are recorded and the file
tier's default directory is). Embedded servers are found in their record, never started, and nothing opens a
network port. Every argument is checked before any server is contacted: a bad one is one line on stderr naming it,
exit 2. The work is :mod:`range_connector.ops` (``cache_inventory``, ``cache_lookup``, ``offline_spec``).

``clear`` is destructive: it asks on a terminal, and without a terminal it refuses unless ``--yes`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from range_connector.cli.common import EXIT_FAILURE, EXIT_OK, Parser, positive_int, print_table
from range_connector.errors import ConfigError

__all__ = ["add_commands"]


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="JSON file of the connector config "
                        "(kv_connector_extra_config, or a --kv-transfer-config document; default: {}, one Valkey "
                        "tier on embedded servers)")
    parser.add_argument("--runtime-dir", type=Path, default=None, help="the config's runtime_dir (embedded servers' "
                        "record; the file tier's default directory)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``cache`` and its ``stats``, ``clear`` and ``lookup`` sub-commands."""
    cache = subparsers.add_parser("cache", help="inspect, clear and query the cache (no engine needed)")
    commands = cache.add_subparsers(dest="cache_command", metavar="{stats,clear,lookup}")
    commands.required = True

    stats = commands.add_parser("stats", help="entries, bytes, budget and last-use times per tier, shard and "
                                "deployment")
    _add_common(stats)
    stats.add_argument("--deployment", default=None, help="only this deployment (default: every one found)")
    stats.add_argument("--tier", default=None, help="only this tier: its index in tiers, or a type (valkey, file)")
    stats.set_defaults(handler=_stats)

    clear = commands.add_parser("clear", help="remove one deployment's entries from the tiers (asks first)")
    _add_common(clear)
    clear.add_argument("--deployment", default=None, help="the deployment to clear (default: the config's)")
    clear.add_argument("--tier", default=None, help="only this tier: its index in tiers, or a type (default: all)")
    clear.add_argument("--yes", action="store_true", help="do not ask (required when stdin is not a terminal)")
    clear.set_defaults(handler=_clear)

    lookup = commands.add_parser("lookup", help="how many tokens of a prompt would hit, from which tier")
    _add_common(lookup)
    lookup.add_argument("--model", required=True, help="the model's directory, as the engine was given "
                        "it (the path is part of the namespace); its tokenizer is loaded from local files only")
    lookup.add_argument("--prompt-file", type=Path, required=True, help="the prompt: text, tokenized as vLLM's "
                        "completions endpoint does (special tokens added; no chat template)")
    lookup.add_argument("--prompt-is-token-ids", action="store_true", help="--prompt-file holds token ids (a JSON "
                        "list, or integers separated by white space or commas)")
    lookup.add_argument("--tensor-parallel-size", type=positive_int, default=1, help="the engine's")
    lookup.add_argument("--block-size", type=positive_int, default=None, help="the engine's (default: vLLM's)")
    lookup.add_argument("--kv-cache-dtype", default="auto", help="the engine's (default: auto)")
    lookup.add_argument("--dtype", default="auto", help="the engine's model dtype (default: auto)")
    lookup.add_argument("--cache-salt", default=None, help="the request's cache_salt, if it had one")
    lookup.set_defaults(handler=_lookup)


# ------------------------------------------------------------------------------------------ checks (no I/O but files)
def _extra(args: argparse.Namespace) -> dict:
    """``kv_connector_extra_config`` from ``--config`` and ``--runtime-dir``; raises ConfigError naming the option."""
    extra: dict = {}
    if args.config is not None:
        try:
            document = json.loads(args.config.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("--config", f"cannot read {args.config}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("--config", f"{args.config} is not JSON: {exc}") from None
        if isinstance(document, dict) and "kv_connector_extra_config" in document:
            document = document["kv_connector_extra_config"]
        if not isinstance(document, dict):
            raise ConfigError("--config", f"{args.config} must hold a JSON object (kv_connector_extra_config)")
        extra = document
    if args.runtime_dir is not None:
        extra = {**extra, "runtime_dir": str(args.runtime_dir)}
    return extra


def _config(args: argparse.Namespace) -> Any:
    """The parsed config (:func:`_extra`); raises ConfigError naming ``--config`` and then the key."""
    from range_connector.config import RangeConfig

    try:
        return RangeConfig.from_extra_config(_extra(args))
    except ConfigError as exc:
        if exc.key.startswith("--"):
            raise
        raise ConfigError("--config", str(exc)) from None


def _deployment(name: str | None) -> str | None:
    from range_connector.config.keys import DEPLOYMENT_PATTERN

    if name is not None and not re.fullmatch(DEPLOYMENT_PATTERN, name):
        raise ConfigError("--deployment", f"{name[:80]!r} does not match {DEPLOYMENT_PATTERN}")
    return name


def _tiers(config: Any, tier: str | None) -> list[int]:
    from range_connector.ops.cache_inventory import select_tiers

    return select_tiers(config, tier)


def _when(unix_s: float | None) -> str:
    return "-" if unix_s is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s))


def _notes(notes: list) -> None:
    for note in notes:
        shard = "" if note.shard_idx is None else f" shard {note.shard_idx}"
        print(f"tier {note.tier_idx} ({note.tier_type}){shard}: {note.message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------- stats
def _stats(args: argparse.Namespace) -> int:
    config = _config(args)
    deployment = _deployment(args.deployment)
    tier_idxs = _tiers(config, args.tier)
    from range_connector.ops.cache_inventory import cache_stats

    rows, notes = cache_stats(config, deployment=deployment, tier_idxs=tier_idxs)
    failed = [n for n in notes if n.tier_type != "memory"]
    if args.json:
        print(json.dumps({"rows": [r.as_dict() for r in rows], "notes": [n.as_dict() for n in notes]}, indent=1))
        return EXIT_FAILURE if failed else EXIT_OK
    header = ("TIER", "TYPE", "SHARD", "DEPLOYMENT", "TICKETS", "STRIPES", "LEASES", "USED_BYTES", "BUDGET_BYTES",
              "OLDEST_USE", "NEWEST_USE", "WHERE")
    table = [header] + [(str(r.tier_idx), r.tier_type, str(r.shard_idx), r.deployment, str(r.num_tickets),
                         str(r.num_stripes), str(r.num_leases), str(r.used_bytes),
                         "-" if r.budget_bytes is None else ("none" if r.budget_bytes == 0 else str(r.budget_bytes)),
                         _when(r.oldest_use_unix_s), _when(r.newest_use_unix_s), r.location) for r in rows]
    if rows:
        print_table(table)
    else:
        print("nothing stored" + (f" for deployment {deployment}" if deployment else ""))
    _notes(notes)
    return EXIT_FAILURE if failed else EXIT_OK


# ---------------------------------------------------------------------------------------------------------- clear
def _confirm(args: argparse.Namespace, what: str) -> bool:
    """Whether to go on: ``--yes``, or the user's "y" on the terminal (the caller refused without one)."""
    if args.yes:
        return True
    answer = input(f"Clear {what}? This cannot be undone. [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _clear(args: argparse.Namespace) -> int:
    config = _config(args)
    deployment = _deployment(args.deployment) or config.deployment
    tier_idxs = _tiers(config, args.tier)
    listed = ", ".join(f"{i} ({config.tiers[i].type})" for i in tier_idxs)
    what = f"deployment {deployment!r} on tier(s) {listed}, every shard"
    if not args.yes and not sys.stdin.isatty():
        raise ConfigError("--yes", f"required to clear without a terminal to ask on ({what})")
    from range_connector.ops.cache_inventory import cache_stats, clear_cache

    if not args.yes:
        rows, _ = cache_stats(config, deployment=deployment, tier_idxs=tier_idxs)
        print(f"{deployment}: {sum(r.num_tickets for r in rows)} tickets, {sum(r.num_stripes for r in rows)} stripes, "
              f"{sum(r.used_bytes for r in rows)} bytes on the tiers named")
        if not _confirm(args, what):
            print("nothing cleared")
            return EXIT_OK
    results = clear_cache(config, deployment=deployment, tier_idxs=tier_idxs)
    failed = [r for r in results if not r.cleared and r.message not in ("nothing stored",)
              and r.tier_type != "memory"]
    if args.json:
        print(json.dumps({"deployment": deployment, "results": [r.as_dict() for r in results]}, indent=1))
    else:
        print_table([("TIER", "TYPE", "SHARD", "DEPLOYMENT", "CLEARED", "WHERE", "NOTE")] + [
            (str(r.tier_idx), r.tier_type, "-" if r.shard_idx is None else str(r.shard_idx), r.deployment,
             "yes" if r.cleared else "no", r.location or "-", r.message) for r in results])
    for r in failed:
        print(f"error: tier {r.tier_idx} ({r.tier_type}) shard {r.shard_idx}: {r.message}", file=sys.stderr)
    return EXIT_FAILURE if failed else EXIT_OK


# --------------------------------------------------------------------------------------------------------- lookup
def _prompt_ids(args: argparse.Namespace) -> list[int] | str:
    """The prompt file's token ids, or its text (tokenized later); raises ConfigError naming the option."""
    try:
        text = args.prompt_file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("--prompt-file", f"cannot read {args.prompt_file}: {exc}") from None
    if not text.strip():
        raise ConfigError("--prompt-file", f"{args.prompt_file} is empty")
    if not args.prompt_is_token_ids:
        return text
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in re.split(r"[\s,]+", text.strip())]
    except ValueError:
        raise ConfigError("--prompt-file", f"{args.prompt_file} does not hold token ids (a JSON list of integers, or "
                                           "integers separated by white space or commas)") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError("--prompt-file", f"{args.prompt_file}: token ids must be non-negative integers")
    return ids


def _tokenize(tokenizer: str, text: str) -> list[int]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError("--model", f"cannot load the tokenizer {tokenizer} from local files: {exc}") from None
    return list(tok(text, add_special_tokens=True)["input_ids"])


def _lookup(args: argparse.Namespace) -> int:
    _config(args)  # (checked now; the offline spec parses it again, as the engine does, with the block size)
    if not Path(args.model).is_dir():
        raise ConfigError("--model", f"{args.model} is not a directory (a local model directory is needed)")
    prompt = _prompt_ids(args)
    if not (Path(args.model) / "config.json").is_file():
        raise ConfigError("--model", f"{args.model} holds no config.json (a local Hugging Face model directory is "
                                     "needed)")
    # vLLM logs to stdout from its first import on: its lines go to stderr here, so that stdout is the answer alone
    with contextlib.redirect_stdout(sys.stderr):
        from range_connector.compat import engine_dtype_choices

        for option, value, choices in zip(("--kv-cache-dtype", "--dtype"), (args.kv_cache_dtype, args.dtype),
                                          engine_dtype_choices()):
            if value not in choices:
                raise ConfigError(option, f"{value!r} is not one of vLLM's: {', '.join(choices)}")
        from range_connector.ops.cache_lookup import lookup_prompt
        from range_connector.ops.offline_spec import offline_namespace

        spec = offline_namespace(args.model, _extra(args), tensor_parallel_size=args.tensor_parallel_size,
                                 block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype)
        token_ids = prompt if isinstance(prompt, list) else _tokenize(spec.tokenizer, prompt)
        answer = lookup_prompt(spec, token_ids, cache_salt=args.cache_salt)
    if args.json:
        print(json.dumps(answer.as_dict(), indent=1))
        return EXIT_OK
    print(f"namespace {answer.namespace_hex}; prompt {answer.num_prompt_tokens} tokens; chunk {answer.chunk_tokens} "
          f"tokens; block {answer.block_size} tokens")
    print_table([("TIER", "TYPE", "SERVED_TOKENS", "STORED_TOKENS", "NOTE")] + [
        (str(t.tier_idx), t.tier_type, str(t.served_tokens), str(t.stored_tokens),
         "" if t.visible else "inside the engine: not visible here") for t in answer.tiers]
        + [("total", "", str(answer.hit_tokens), "", "tail stored" if answer.tail_stored else "")])
    if answer.load_mode == "auto":
        print("load_mode auto: the engine's cost gate may take less than this")
    return EXIT_OK
