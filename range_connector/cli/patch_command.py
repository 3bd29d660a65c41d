"""``range-connector patch check|apply|revert``: the engine patch on the installed vLLM.

The patch machinery (finding vLLM, checking the file's hash, the atomic writes, the backup) is
:mod:`range_connector.cli.patch`, imported when a handler runs; this module is the command's parsers and handlers.
``check`` exits ``EXIT_OK`` when the patch is applied and ``EXIT_PATCH_NOT_APPLIED`` when not; a file that is not
the pinned vLLM's raises :class:`~range_connector.errors.PatchMismatchError` (the entry point exits 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from range_connector.cli.common import EXIT_OK, EXIT_PATCH_NOT_APPLIED, Parser

__all__ = ["add_commands"]


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``patch`` and its ``check``, ``apply`` and ``revert`` sub-commands."""
    patch_parser = subparsers.add_parser(
        "patch", help="the engine patch: MLA's direct-call branch reaches the connector's per-layer hooks")
    patch_commands = patch_parser.add_subparsers(dest="patch_command", metavar="{check,apply,revert}")
    patch_commands.required = True
    for name, handler, help_text in (
        ("check", _patch_check, "exit 0 if applied, 3 if not applied, 2 if the file is not the pinned vLLM's"),
        ("apply", _patch_apply, "apply it (atomic write, the original kept as a backup); a no-op if applied"),
        ("revert", _patch_revert, "restore the original bytes and remove the backup; a no-op if not applied"),
    ):
        command = patch_commands.add_parser(name, help=help_text)
        command.add_argument("--vllm-dir", type=Path, default=None,
                             help="vLLM's package directory (default: the installed vLLM, found without importing it)")
        command.set_defaults(handler=handler)


def _patch_check(args: argparse.Namespace) -> int:
    from range_connector.cli.patch import PatchState, patch_status

    status = patch_status(args.vllm_dir)
    print(f"{status.state.value}: {status.target}")
    return EXIT_OK if status.state is PatchState.APPLIED else EXIT_PATCH_NOT_APPLIED


def _patch_apply(args: argparse.Namespace) -> int:
    from range_connector.cli.patch import PATCH_NAME, apply_patch

    status, changed = apply_patch(args.vllm_dir)
    print(f"applied {PATCH_NAME} to {status.target} (original kept in {status.backup})" if changed
          else f"already applied: {status.target}")
    return EXIT_OK


def _patch_revert(args: argparse.Namespace) -> int:
    from range_connector.cli.patch import revert_patch

    status, changed = revert_patch(args.vllm_dir)
    print(f"reverted: {status.target}" if changed else f"not applied: {status.target}")
    return EXIT_OK
