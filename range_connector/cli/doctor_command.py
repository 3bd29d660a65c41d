"""``range-connector doctor``: check an installation and a config without starting an engine.

The checks are :mod:`range_connector.ops.doctor` (imported when the handler runs); this module is the command's
parser and handler. It prints one row per check (``CHECK STATUS DETAIL``) or, with ``--json``, one JSON object
(:func:`~range_connector.ops.doctor.results_json`), and exits ``EXIT_OK`` only when no check failed, else
``EXIT_FAILURE`` with the first failure's row repeated as one line on stderr. Bad arguments (an unreadable
``--config``, a ``--model`` without ``config.json`` or whose heads ``--tensor-parallel-size`` does not divide, a
``--vllm-dir`` that is not a package directory) exit ``EXIT_BAD_INPUT`` naming the option before any check runs.
vLLM's log lines (it logs to stdout from its first import on) go to stderr, so stdout is the table or the JSON alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from range_connector.cli.common import EXIT_FAILURE, EXIT_OK, Parser, positive_int, positive_ints, print_table
from range_connector.errors import ConfigError

if TYPE_CHECKING:
    from range_connector.ops.doctor import InstallFacts

__all__ = ["add_commands", "install_facts"]


def add_commands(subparsers: argparse._SubParsersAction[Parser]) -> None:
    """Register ``doctor``."""
    doctor = subparsers.add_parser(
        "doctor", help="check vLLM, the engine patch, every tier of a config and the model's namespace; exit 0 "
        "only when everything is usable",
        description="Check an installation and a config without starting an engine: the vLLM version and the "
        "engine patch, each tier (reachable with its credentials, latency, a short bandwidth probe under a "
        "throw-away deployment that is removed afterwards, server limits, disk space and O_DIRECT), the data "
        "stored for the model, and what the cost gate would decide for a few prompt lengths.")
    doctor.add_argument("--config", required=True, type=Path, metavar="FILE",
                        help="JSON file: kv_connector_extra_config, or a whole --kv-transfer-config")
    doctor.add_argument("--model", help="model directory (its config.json gives the KV layout); without it the "
                        "model checks are skipped")
    doctor.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="the engines' tensor-parallel size (KV heads per rank; default 1)")
    doctor.add_argument("--block-size", type=positive_int, default=None,
                        help="the engines' block size, tokens (default: vLLM's on CPU, 16 for MLA, else 128)")
    doctor.add_argument("--vllm-dir", type=Path, default=None,
                        help="vLLM's package directory (default: the installed vLLM)")
    doctor.add_argument("--probe-mib", type=positive_int, default=4,
                        help="MiB written and read back by each shard's bandwidth probe (default 4)")
    doctor.add_argument("--prompt-tokens", type=positive_ints, default=None,
                        help="prompt lengths of the cost-gate row (default 512,2048,8192,32768)")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    doctor.set_defaults(handler=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from range_connector.ops.doctor import (
        DEFAULT_GATE_PROMPT_TOKENS,
        DoctorOptions,
        Status,
        is_usable,
        load_config_file,
        model_view_from_config_json,
        result_rows,
        results_json,
        run_doctor,
    )

    # every argument is checked before any check runs (ConfigError naming the option: exit 2)
    extra = load_config_file(args.config)
    if args.model is not None:  # (a model directory that cannot be read is bad input)
        model_view_from_config_json(args.model, args.tensor_parallel_size, args.block_size)
    if args.vllm_dir is not None and not (args.vllm_dir / "__init__.py").is_file():
        raise ConfigError("--vllm-dir", f"{args.vllm_dir} is not a Python package directory (no __init__.py); give "
                                        "vLLM's package directory, the one holding vllm/__init__.py")
    opts = DoctorOptions(extra_config=extra, model=args.model, tensor_parallel_size=args.tensor_parallel_size,
                         block_size=args.block_size, install=install_facts(args.vllm_dir),
                         probe_bytes=args.probe_mib << 20,
                         gate_prompt_tokens=args.prompt_tokens or DEFAULT_GATE_PROMPT_TOKENS)
    # vLLM logs to stdout from its first import on (the namespace check resolves its config): its lines go to
    # stderr, so that stdout is the table or the JSON alone
    with contextlib.redirect_stdout(sys.stderr):
        results = run_doctor(opts)
    if args.json:
        print(json.dumps(results_json(results), indent=2))
    else:
        print_table(result_rows(results))
    failed = [r for r in results if r.status is Status.FAIL]
    if failed:
        print(f"error: {failed[0].name}: {failed[0].detail}" + (f" (and {len(failed) - 1} more failed checks)"
                                                               if len(failed) > 1 else ""), file=sys.stderr)
    return EXIT_OK if is_usable(results) else EXIT_FAILURE


def install_facts(vllm_dir: Path | None) -> InstallFacts | None:
    """What :mod:`range_connector.cli.patch` finds of vLLM in ``vllm_dir`` (``None``: the installed one): its
    version and the engine patch's state; ``None`` when no vLLM is installed and no directory is given."""
    from range_connector.cli.patch import PatchState, _installed_version, default_vllm_dir, patch_status
    from range_connector.errors import PatchMismatchError, RangeError
    from range_connector.ops.doctor import InstallFacts

    try:
        directory = vllm_dir if vllm_dir is not None else default_vllm_dir()
    except RangeError:
        return None
    version = _installed_version(directory)
    try:
        status = patch_status(directory)
    except (PatchMismatchError, RangeError) as exc:
        return InstallFacts(directory, None if version == "unknown" else version, None, "", str(exc))
    return InstallFacts(directory, None if version == "unknown" else version, status.state is PatchState.APPLIED,
                        str(status.target))
