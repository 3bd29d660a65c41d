"""Range's storage path as an L2 adapter of LMCache's multi-process server (docs/lmcache.md).

* :mod:`.config`: the adapter's parameters (LMCache's ``adapter_params``) as a frozen tree; no LMCache import.
* :mod:`.objects`: :class:`~.objects.ObjectStore`, LMCache objects as Range stripes and tickets on one backend per
  shard (one batched call per shard per task); no LMCache import, so it is tested without LMCache.
* :mod:`.adapter`: :class:`~.adapter.RangeL2Adapter`, LMCache's ``L2AdapterInterface`` (imports LMCache: load it
  only inside LMCache's environment).

Nothing here imports vLLM.
"""
