"""``range-connector doctor``: check an installation and a config without starting an engine.

:func:`run_doctor` runs every check and returns one :class:`CheckResult` per row of the table: the installed vLLM
and the engine patch (:class:`InstallFacts`, which the command reads with ``range-connector patch``'s code; needed
only for MLA models on platforms whose attention takes the direct-call branch), the config itself, each tier
(:mod:`range_connector.ops.doctor_tiers`: reachable with its credentials and TLS, latency, a short bandwidth probe
under a throw-away deployment that is removed afterwards, server limits, disk space and ``O_DIRECT`` for files, the
data stored under the config's deployment), the model's KV layout and the namespace an engine would compute for it
(``--model``; :func:`~range_connector.ops.offline_spec.offline_namespace`, the engine's own resolution), and what
the cost gate (:mod:`range_connector.cost`) would decide for a few prompt lengths on each tier with the
calibration's ``B`` and ``T0`` (or the gate's defaults).

A row is ``ok``, ``warn`` (usable, but worth reading) or ``fail`` (an engine with this config would fail or serve no
hits); :func:`is_usable` is True when no row fails. Nothing here starts an engine or a server: embedded Valkey
servers that are not running are reported, not started.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from range_connector.compat import PINNED_VLLM_VERSION
from range_connector.config import RangeConfig
from range_connector.errors import ConfigError
from range_connector.ops.checks import CheckResult, ModelView, Status, model_view_from_config_json
from range_connector.ops.doctor_tiers import TierCheck, check_file_tier, check_memory_tier, check_stored_data
from range_connector.ops.doctor_valkey import check_valkey_tier

__all__ = [
    "DEFAULT_GATE_PROMPT_TOKENS", "CheckResult", "DoctorOptions", "InstallFacts", "ModelView", "Status", "is_usable",
    "load_config_file", "model_view_from_config_json", "result_rows", "results_json", "run_doctor",
]

#: prompt lengths (tokens) the gate row decides for
DEFAULT_GATE_PROMPT_TOKENS = (512, 2048, 8192, 32768)


@dataclass(frozen=True, slots=True)
class InstallFacts:
    """What the command found of the installed vLLM (read from its files, without importing it).

    Attributes:
        vllm_dir: vLLM's package directory.
        vllm_version: its version (``None``: unknown).
        patch_applied: whether the engine patch is applied to its file (``None``: cannot tell, see
            ``patch_error``).
        patch_target: the file the patch changes.
        patch_error: why the patch state cannot be told (a file that is not the pinned vLLM's), else ``None``.
    """

    vllm_dir: Path
    vllm_version: str | None
    patch_applied: bool | None
    patch_target: str
    patch_error: str | None = None


@dataclass(frozen=True, slots=True)
class DoctorOptions:
    """Inputs of :func:`run_doctor`.

    Attributes:
        extra_config: the ``kv_connector_extra_config`` mapping.
        model: model directory (``None``: the model-dependent checks are skipped, with a warning).
        tensor_parallel_size: the engine's tensor-parallel size (heads per rank).
        block_size: the engine's block size, tokens (``None``: the platform's default for the model).
        install: what was found of vLLM and the engine patch (``None``: vLLM not installed).
        probe_bytes: bytes written and read back by each tier's bandwidth probe, per shard.
        gate_prompt_tokens: prompt lengths the gate row decides for.
    """

    extra_config: Mapping[str, Any]
    model: str | None = None
    tensor_parallel_size: int = 1
    block_size: int | None = None
    install: InstallFacts | None = None
    probe_bytes: int = 4 << 20
    gate_prompt_tokens: tuple[int, ...] = DEFAULT_GATE_PROMPT_TOKENS


def load_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config file: a JSON object that is either ``kv_connector_extra_config`` itself or a whole
    ``--kv-transfer-config`` (whose ``kv_connector_extra_config`` is taken).

    Raises:
        ConfigError: the file cannot be read or is not a JSON object (key ``--config``).
    """
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("--config", f"{path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError("--config", f"{path}: not JSON ({exc})") from None
    if isinstance(data, dict) and isinstance(data.get("kv_connector_extra_config"), dict):
        data = data["kv_connector_extra_config"]
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path}: not a JSON object")
    return data


def is_usable(results: Sequence[CheckResult]) -> bool:
    """True when no check failed (warnings do not count)."""
    return all(r.status is not Status.FAIL for r in results)


def result_rows(results: Sequence[CheckResult]) -> list[tuple[str, str, str]]:
    """The table: a header, then ``(CHECK, STATUS, DETAIL)`` per result."""
    return [("CHECK", "STATUS", "DETAIL"), *((r.name, r.status.value, r.detail) for r in results)]


def results_json(results: Sequence[CheckResult]) -> dict[str, Any]:
    """``{"usable": bool, "checks": [{"name", "status", "detail", "data"}]}`` (JSON-safe)."""
    return {"usable": is_usable(results),
            "checks": [{"name": r.name, "status": r.status.value, "detail": r.detail, "data": dict(r.data)}
                       for r in results]}


def run_doctor(opts: DoctorOptions) -> list[CheckResult]:
    """Run every check (module docstring), in table order.

    Returns:
        One result per row; a check that cannot run because an earlier one failed is left out or reported as such.

    Raises:
        Nothing for what it checks (failures are rows); only programming errors propagate.
    """
    results = [check_vllm(opts.install)]
    view: ModelView | None = None
    model_row: CheckResult | None = None
    if opts.model is not None:
        try:
            view = model_view_from_config_json(opts.model, opts.tensor_parallel_size, opts.block_size)
        except ConfigError as exc:
            model_row = CheckResult("model", Status.FAIL, str(exc))
    results.append(check_patch(opts.install, None if view is None else view.is_mla))
    try:
        config = RangeConfig.from_extra_config(opts.extra_config)
    except ConfigError as exc:
        return [*results, CheckResult("config", Status.FAIL, str(exc))]
    results.append(CheckResult("config", Status.OK, _describe_config(config)))
    namespace_row = None
    if view is not None:
        view, namespace_row = check_namespace(opts, view)
        model_row = CheckResult("model", Status.OK, _describe_view(view, opts.tensor_parallel_size), {
            "num_layers": view.num_layers, "block_size": view.block_size,
            "layer_block_bytes": view.layer_block_bytes, "is_mla": view.is_mla})
    if model_row is not None:
        results.append(model_row)
    tiers = [check_tier(config.for_tier(i), view, opts.probe_bytes) for i in range(len(config.tiers))]
    for tier in tiers:
        results.extend(tier.results)
    if namespace_row is not None:
        results.append(namespace_row)
    results.append(check_stored_data(config, view, tiers))
    results.append(check_gate(config, view, opts.gate_prompt_tokens))
    return results


def check_namespace(opts: DoctorOptions, view: ModelView) -> tuple[ModelView, CheckResult]:
    """The namespace an engine of ``opts.model`` with this config would compute, by the engine's own resolution
    without starting one (:func:`~range_connector.ops.offline_spec.offline_namespace`: vLLM's config and platform
    rules, the KV-cache group, the CPU instruction-set packing).

    Args:
        opts: the model, config, tensor-parallel size and block size.
        view: the geometry read from ``config.json`` (kept when vLLM cannot resolve the model).

    Returns:
        ``(view, row)``: the view as the engine would register it (block size, page bytes, heads) with its
        namespace, or ``view`` unchanged and a failed row naming why vLLM refused.
    """
    from range_connector.ops.offline_spec import offline_namespace

    try:
        spec = offline_namespace(opts.model or view.model, opts.extra_config,
                                 tensor_parallel_size=opts.tensor_parallel_size, block_size=opts.block_size)
    except (ConfigError, ValueError, OSError, RuntimeError, ImportError) as exc:  # (vLLM's refusals: a row)
        return view, CheckResult("namespace", Status.FAIL, f"an engine could not resolve this model and config: "
                                                           f"{exc}")
    group = spec.group
    view = ModelView(view.model, group.is_mla, spec.num_layers, group.block_size, spec.ranks.total_heads,
                     group.page_size_bytes, int(spec.fields["kv_spec"]["head_page_size_bytes"]), spec.namespace_hex)
    detail = (f"{spec.namespace_hex} (packing {spec.fields['packing']}, block {spec.fields['block_size']}, chunk "
              f"{spec.chunk_tokens} tokens, {spec.fields['num_shards']} shard(s))")
    return view, CheckResult("namespace", Status.OK, detail, {"namespace": spec.namespace_hex,
                                                              "fields": spec.fields})


def check_tier(config: RangeConfig, view: ModelView | None, probe_bytes: int) -> TierCheck:
    """Check the config's current tier (``config.for_tier(i)``): :mod:`~range_connector.ops.doctor_tiers` has what
    is checked. Never raises for what it checks: failures are rows of the result."""
    if config.tier.type == "valkey":
        return check_valkey_tier(config, view, probe_bytes)
    if config.tier.type == "file":
        return check_file_tier(config, view, probe_bytes)
    return check_memory_tier(config, probe_bytes)


def _describe_view(view: ModelView, tp: int) -> str:
    kind = "MLA" if view.is_mla else f"{view.num_kv_heads} KV heads"
    return (f"{view.model}: {view.num_layers} layers, {kind}, block {view.block_size} tokens; one block row "
            f"(a layer, all planes, one rank at TP {tp}) = {view.layer_block_bytes} bytes")


def _describe_config(config: RangeConfig) -> str:
    tiers = " -> ".join(t.type for t in config.tiers)
    return f"tiers {tiers}; {config.num_shards} shard(s); deployment {config.deployment!r}"


def check_vllm(install: InstallFacts | None) -> CheckResult:
    """The installed vLLM is the one Range is pinned to (:data:`~range_connector.compat.PINNED_VLLM_VERSION`).

    A different version fails: the compatibility module and the engine patch are written against the pinned one.
    """
    if install is None:
        return CheckResult("vllm", Status.FAIL, f"vLLM is not installed in this Python environment; install vllm "
                                                f"{PINNED_VLLM_VERSION}")
    version = install.vllm_version or "unknown"
    data = {"version": version, "pinned_version": PINNED_VLLM_VERSION, "directory": str(install.vllm_dir)}
    if version.split("+")[0] != PINNED_VLLM_VERSION:
        return CheckResult("vllm", Status.FAIL, f"vLLM {version} is installed in {install.vllm_dir}; Range is "
                                                f"written for {PINNED_VLLM_VERSION}", data)
    return CheckResult("vllm", Status.OK, f"vLLM {version} (pinned {PINNED_VLLM_VERSION})", data)


def direct_call_branch_taken() -> bool:
    """Whether MLA layers in an engine process here would take ``MLAAttention.forward``'s direct-call branch: the
    platform's ``opaque_attention_op()`` is False, or the test switch of :mod:`range_connector.plugin` is set (read
    from the environment; this process's platform is not changed)."""
    from range_connector.plugin import FORCE_MLA_DIRECT_CALL_ENV

    if os.environ.get(FORCE_MLA_DIRECT_CALL_ENV, "") == "1":
        return True
    from range_connector import compat

    return compat.mla_direct_call_branch_taken()


def check_patch(install: InstallFacts | None, is_mla: bool | None) -> CheckResult:
    """The engine patch (``range-connector patch``): needed for MLA models where attention takes the direct-call
    branch (:func:`direct_call_branch_taken`); there, not applied is a failure.

    Args:
        install: what was found of vLLM (``None``: not installed).
        is_mla: the model is MLA (``None``: no model given; the patch is then needed only if one is MLA).
    """
    if install is None:
        return CheckResult("engine patch", Status.FAIL, "cannot check: vLLM is not installed")
    try:
        direct = direct_call_branch_taken()
    except ImportError as exc:
        return CheckResult("engine patch", Status.FAIL, f"cannot import vLLM's platform ({exc})")
    applied, where = install.patch_applied, install.patch_target
    needed = direct and is_mla is not False
    data = {"applied": applied, "direct_call_branch": direct, "needed": needed if is_mla is not None else None}
    state = "applied" if applied else "not applied"
    if install.patch_error is not None:
        status = Status.FAIL if needed and is_mla else Status.WARN
        return CheckResult("engine patch", status, f"cannot check: {install.patch_error}", data)
    if not direct:
        return CheckResult("engine patch", Status.OK, f"not needed (this platform registers attention as one opaque "
                                                      f"op); {state}", data)
    if applied:
        return CheckResult("engine patch", Status.OK, f"needed for MLA models here, applied ({where})", data)
    if is_mla:
        return CheckResult("engine patch", Status.FAIL, f"needed (MLA model, attention takes the direct-call branch) "
                                                        f"and not applied to {where}: run `range-connector patch "
                                                        "apply` and restart the engines", data)
    if is_mla is None:
        return CheckResult("engine patch", Status.WARN, "not applied; needed only for MLA models on this platform "
                                                        "(give --model to decide)", data)
    return CheckResult("engine patch", Status.OK, "not needed (the model is not MLA); not applied", data)


def check_gate(config: RangeConfig, view: ModelView | None,
               prompt_tokens: Sequence[int] = DEFAULT_GATE_PROMPT_TOKENS) -> CheckResult:
    """What the cost gate would decide for a whole-prompt hit (all but the last token, block-rounded) at each of
    ``prompt_tokens`` on each tier, seeded as an engine seeds it: the config's calibration file (``B`` and ``T0``
    per tier, ``R``), else :class:`~range_connector.cost.gate.GateConfig`'s defaults. Never fails: a tier the gate
    refuses at every length is a warning (loads from it would never pay off).
    """
    from range_connector.cost.gate import CostGate
    from range_connector.cost.model import layout_bytes_per_token

    if view is None:
        return CheckResult("cost gate", Status.WARN, "skipped: give --model (the gate needs the KV bytes per token)")
    calibration, source = None, "defaults (no calibration_file)"
    if config.calibration_file:
        from range_connector.cost.calibration_file import load_calibration

        try:
            calibration, source = load_calibration(config.calibration_file), f"calibration {config.calibration_file}"
        except (ConfigError, OSError) as exc:
            return CheckResult("cost gate", Status.FAIL, f"calibration_file: {exc}")
    chunk_tokens = config.resolve(view.block_size).chunk_tokens or view.block_size
    bytes_per_token = layout_bytes_per_token(view.layer_block_bytes, view.num_layers, view.block_size)
    parts, data, never = [], {}, []
    for tier in config.tiers:
        gate = CostGate(tier.type, config.num_shards, bytes_per_token, view.num_layers, view.block_size,
                        chunk_tokens, calibration=calibration)
        decisions = []
        for n in prompt_tokens:
            hit = (n - 1) // view.block_size * view.block_size
            d = gate.decide(n, 0, hit, now_s=0.0)
            decisions.append((n, "refuse" if d.is_probe else d.action.value, 0 if d.is_probe else d.num_new_tokens))
        est = gate.tiers.combined(tier.type, gate.num_shards)
        data[f"tiers[{tier.index}]"] = {"type": tier.type, "bandwidth_bytes_per_s": est.bandwidth_bytes_per_s,
                                        "t0_s": est.t0_s, "decisions": [list(x) for x in decisions]}
        parts.append(f"tiers[{tier.index}] {tier.type}: " + ", ".join(f"{n} {a}" for n, a, _ in decisions))
        if all(a == "refuse" for _, a, _ in decisions):
            never.append(f"tiers[{tier.index}]")
    detail = f"{'; '.join(parts)} ({source})"
    if never:
        return CheckResult("cost gate", Status.WARN, f"{detail}; {', '.join(never)} never pays off", data)
    return CheckResult("cost gate", Status.OK, detail, data)
