"""Run one real vLLM engine (CPU) through a scripted list of steps and write the results as JSON.

Used by the integration tests as a subprocess (one fresh engine process per run): ``python engine_harness.py
SPEC.json OUT.json``. Steps:

* ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": N, "kv_transfer_params": {...} or [...]}`` ->
  ``{"token_ids": [[...], ...], "kv_transfer_params": [...], "external_hits": tokens, "external_queries": tokens}``
  (hits and queries: deltas of vLLM's own counters). ``kv_transfer_params`` go into each request's
  ``SamplingParams.extra_args`` as vLLM's OpenAI server puts them, and each output's come back (what the connector's
  ``request_finished`` returned): a test plays the disaggregated proxy's two calls this way between two engine runs;
* ``{"op": "range_metrics"}`` -> ``{"metrics": [{"name", "labels", "value", "count", "buckets"}]}`` of every
  ``vllm:range*`` metric (``count`` and ``buckets``, ``le -> cumulative count``, of histograms; ``value`` of the
  others); a ``generate`` step's ``"prompt_logprobs": n`` asks each request for its prompt's logprobs;
* ``{"op": "last_loads"}`` -> block ids the connector wrote since the previous ``last_loads``, with their digests
  read from the engine's KV cache;
* ``{"op": "block_digests"}`` -> digests of every non-zero block of the engine's KV cache;
* ``{"op": "digests", "block_ids": [...]}``; ``{"op": "reset_prefix_cache"}``; ``{"op": "sleep", "seconds": s}``;
* ``{"op": "signal_servers", "runtime_dir": d, "signal": "STOP" | "CONT" | "KILL"}`` (embedded Valkey servers);
* ``{"op": "count_layer_hooks"}`` (counts start) and ``{"op": "layer_hook_counts"}`` -> ``{"counts": {hook:
  {layer_name: calls}}}`` of the connector's per-layer hooks (``wait_for_layer_load``, ``save_kv_layer``);
* ``{"op": "mla_probe"}`` -> the worker's MLA branch probes and each attention layer's ``use_direct_call``;
* ``{"op": "mark", "path": p}`` writes an empty file at ``p``, and ``{"op": "wait_for", "path": p, "timeout_s": s}``
  waits until a file exists at ``p`` (fails past ``s``): a test acts on the tiers between two steps of one engine;
* ``{"op": "corrupt", "url": valkey URL, "byte_offset": n, "rank": r}`` -> flips one byte of layer 0 of the first
  chunk tensor-parallel rank ``r`` (default 0) read in its last loading step (inside the chunk's first block, in the
  stripe's value);
* ``{"op": "last_loads_ranks"}`` and ``{"op": "block_digests_ranks"}``: ``last_loads`` and ``block_digests`` of every
  tensor-parallel rank (lists in rank order);
* ``{"op": "head_digests", "last_loads": bool, "tp_size": T}`` -> ``{"heads": {model head: [digests]}}`` of every
  block (or of the blocks the connector loaded last) of every rank, per KV head (comparable across TP sizes);
* ``{"op": "delete_loaded_ticket", "url": valkey URL, "rank": r, "index": i}`` -> deletes rank ``r``'s ticket of the
  ``i``-th chunk it loaded last (one rank's slice of that chunk evicted).

``spec["connector"]`` is Range's ``kv_connector_extra_config`` (``None``: no connector); without it,
``spec["kv_transfer_config"]`` gives another connector's ``KVTransferConfig`` fields (``tests/lmcache``: LMCache's
MP connector), and the connector-specific ops (``last_loads``, ``corrupt``, ...) do not apply;
``spec["llvmlite_workaround"]`` (see :func:`_llvmlite_workaround`) lets such an engine run in one process.

Process layout (``spec["processes"]``): ``"one"`` (the default) runs vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and, at tensor-parallel size 1, its worker too (the ``uni`` executor): one
Python process instead of three, which saves about 45 s of imports per engine on the 2-core machine (measured: 20 s
against 65 s for the same start and generate). The scheduler and the worker then share a process, but they still talk
only through vLLM's scheduler output and connector output. ``"vllm"`` keeps vLLM's own layout (an engine-core
process and one worker process per rank: metadata crosses process boundaries pickled, as under ``vllm serve``); the
tensor-parallel tests run their workers as processes in both layouts, and every ``vllm serve`` test
(``tests/integration/test_api_server.py``, the README quick start, metrics, P/D) runs vLLM's layout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def _counter(llm, name: str) -> int:
    total = 0
    for m in llm.get_metrics():
        if m.name == name:
            total += int(getattr(m, "value", 0))
    return total


def _llvmlite_workaround() -> None:
    """Let vLLM-CPU's kernel registration run in a process that has imported llvmlite (LMCache imports numba).

    ``vllm.triton_utils.dispatcher._rebind_kernels`` reads ``vars(value)`` of every module attribute; llvmlite's
    library wrapper (``llvmlite.binding.ffi.lib``) answers ``__dict__`` with a wrapped ctypes attribute, not a
    mapping, and the engine's start-up fails (``'_lib_fn_wrapper' object has no attribute 'get'``). Pre-seeding the
    wrapper's table with an empty mapping under ``__dict__`` gives vLLM a mapping; nothing in llvmlite reads it.
    vLLM's own process layout (``"processes": "vllm"``) does not need this.
    """
    from llvmlite.binding import ffi

    ffi.lib._fntab["__dict__"] = {}


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    kwargs = dict(spec.get("engine_args", {}))
    processes = spec.get("processes", "one")
    if processes == "one":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if kwargs.get("tensor_parallel_size", 1) == 1:
            kwargs.setdefault("distributed_executor_backend", "uni")
    elif processes != "vllm":
        raise ValueError(f"processes must be 'one' or 'vllm', not {processes!r}")

    if spec.get("llvmlite_workaround"):
        _llvmlite_workaround()

    import msgpack
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from range_connector.testing import debug

    ktc = None
    if spec.get("connector") is not None:  # roles: "kv_both" (the default), "kv_producer", "kv_consumer"
        ktc = KVTransferConfig(kv_connector="RangeConnector", kv_role=spec.get("role", "kv_both"),
                               kv_load_failure_policy="recompute", kv_connector_extra_config=spec["connector"])
    elif spec.get("kv_transfer_config") is not None:  # another connector (LMCache's MP connector): its fields
        ktc = KVTransferConfig(**spec["kv_transfer_config"])
    llm = LLM(model=spec["model"], enforce_eager=True, max_model_len=spec.get("max_model_len", 2048),
              block_size=spec.get("block_size", 128), kv_transfer_config=ktc, disable_log_stats=False,
              seed=0, **kwargs)
    results = []
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            t0 = time.monotonic()
            hits0 = _counter(llm, "vllm:external_prefix_cache_hits")
            queries0 = _counter(llm, "vllm:external_prefix_cache_queries")
            params = step.get("kv_transfer_params")  # one dict for every prompt, or one per prompt
            per_prompt = params if isinstance(params, list) else [params] * len(step["prompts"])
            sampling = [SamplingParams(temperature=0, max_tokens=step.get("max_tokens", 16),
                                       extra_args={"kv_transfer_params": p} if p is not None else None,
                                       prompt_logprobs=step.get("prompt_logprobs"))
                        for p in per_prompt]
            outs = llm.generate([{"prompt_token_ids": p} for p in step["prompts"]], sampling, use_tqdm=False)
            results.append({
                "token_ids": [list(o.outputs[0].token_ids) for o in outs],
                "kv_transfer_params": [o.kv_transfer_params for o in outs],
                "external_hits": _counter(llm, "vllm:external_prefix_cache_hits") - hits0,
                "external_queries": _counter(llm, "vllm:external_prefix_cache_queries") - queries0,
                "elapsed_s": time.monotonic() - t0,
            })
        elif op == "last_loads":
            ids = llm.collective_rpc(debug.connector_loaded_block_ids)[0]
            digests = llm.collective_rpc(debug.engine_block_digests, args=(ids,))[0]
            results.append({"block_ids": ids, "digests": [digests[b] for b in ids]})
        elif op == "last_loads_ranks":  # every tensor-parallel rank's, in rank order
            ids = llm.collective_rpc(debug.connector_loaded_block_ids)
            digests = [llm.collective_rpc(debug.engine_block_digests, args=(rank_ids,))[r]
                       for r, rank_ids in enumerate(ids)]
            results.append({"block_ids": ids, "digests": [[d[b] for b in rank_ids]
                                                          for d, rank_ids in zip(digests, ids)]})
        elif op == "block_digests_ranks":
            results.append({"digests": llm.collective_rpc(debug.engine_block_digests)})
        elif op == "head_digests":  # every rank's blocks (or its last loads), per model KV head: {head: [digests]}
            ids = llm.collective_rpc(debug.connector_loaded_block_ids) if step.get("last_loads") else None
            per_rank = [llm.collective_rpc(debug.engine_head_digests, args=(ids[r] if ids else None,))[r]
                        for r in range(len(ids) if ids else step.get("tp_size", 1))]
            heads: dict[str, list[str]] = {}
            for rank_digests in per_rank:
                for _block, by_head in sorted(rank_digests.items()):
                    for head, digest in by_head.items():
                        heads.setdefault(str(head), []).append(digest)
            results.append({"heads": heads})
        elif op == "delete_loaded_ticket":  # one rank's ticket of one chunk it loaded last (one slice evicted)
            import valkey

            from range_connector.backends.base import deployment_key_prefix

            client = valkey.Valkey.from_url(step["url"])
            _shard, tkey = llm.collective_rpc(debug.connector_last_loaded_tickets)[step.get("rank", 0)][step["index"]]
            tkey = deployment_key_prefix(step.get("deployment", "default")) + tkey  # (worker keys are per deployment)
            results.append({"deleted": int(client.delete(tkey)), "key": tkey})
        elif op == "range_metrics":  # Range's metrics as vLLM's metric reader shows them, with their labels
            results.append({"metrics": [{"name": m.name, "labels": dict(getattr(m, "labels", {}) or {}),
                                         "value": getattr(m, "value", None), "count": getattr(m, "count", None),
                                         "buckets": getattr(m, "buckets", None)}
                                        for m in llm.get_metrics() if m.name.startswith("vllm:range")]})
        elif op == "worker_stats":
            results.append({"stats": llm.collective_rpc(debug.connector_worker_stats)[0]})
        elif op == "load_timelines":
            results.append({"timelines": llm.collective_rpc(debug.connector_load_timelines)[0]})
        elif op == "block_digests":
            results.append({"digests": llm.collective_rpc(debug.engine_block_digests)[0]})
        elif op == "digests":
            results.append({"digests": llm.collective_rpc(debug.engine_block_digests, args=(step["block_ids"],))[0]})
        elif op == "count_layer_hooks":
            llm.collective_rpc(debug.count_layer_hooks)
            results.append({"ok": True})
        elif op == "layer_hook_counts":
            results.append({"counts": llm.collective_rpc(debug.layer_hook_counts)[0]})
        elif op == "mla_probe":
            results.append(llm.collective_rpc(debug.mla_branch_probe)[0])
        elif op == "reset_prefix_cache":  # (refused while a finished request's blocks are not yet freed: retried)
            ok = bool(llm.reset_prefix_cache())
            for _ in range(50 if not ok else 0):
                time.sleep(0.1)
                ok = bool(llm.reset_prefix_cache())
                if ok:
                    break
            results.append({"ok": ok})
        elif op == "corrupt":
            import valkey

            client = valkey.Valkey.from_url(step["url"])
            _shard, tkey = llm.collective_rpc(debug.connector_last_loaded_tickets)[step.get("rank", 0)][0]
            # A ticket is [version, stripe_id, block_offset, num_blocks, stripe_blocks, layers, planes, row_bytes, ...]
            from range_connector.backends.base import deployment_key_prefix

            prefix = deployment_key_prefix(step.get("deployment", "default"))  # tickets keys are per deployment
            ticket = msgpack.unpackb(client.get(prefix + tkey))
            key = f"{prefix}s:{ticket[1]}:0"  # layer 0 of the stripe
            offset = ticket[2] * ticket[7] + step.get("byte_offset", 0)  # inside the chunk's first block
            value = bytearray(client.get(key))
            value[offset] ^= 0xFF
            client.set(key, bytes(value))
            results.append({"key": key, "offset": offset})
        elif op == "signal_servers":
            from range_connector.backends.valkey.servers import server_status

            for server in server_status(step["runtime_dir"]):
                os.kill(server.pid, getattr(signal, "SIG" + step["signal"]))
            results.append({"ok": True})
        elif op == "mark":
            open(step["path"], "w").close()
            results.append({"ok": True})
        elif op == "wait_for":
            deadline = time.monotonic() + step.get("timeout_s", 300)
            while not os.path.exists(step["path"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step['path']} did not appear within {step.get('timeout_s', 300)} s")
                time.sleep(0.05)
            results.append({"ok": True})
        elif op == "sleep":
            time.sleep(step["seconds"])
            results.append({"ok": True})
        else:
            raise ValueError(f"unknown op {op!r}")
    with open(out_path, "w") as f:
        json.dump({"results": results}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
