"""The shim's reference paths: ``plain_valkey_per_object`` (valkey-py, one key per object) and ``resident``.

:class:`_PlainValkeyImpl` stores one Valkey key per object and restores with one non-transactional pipeline of GETs
per layer; :class:`_ResidentImpl` copies the payload from one contiguous in-memory image with one ``index_copy_`` per
layer (the "already resident" limit). Both deliver through the :class:`~lmcache_shim_child._PathBench`; valkey and
torch are imported inside the methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache_shim_common import _host_port

if TYPE_CHECKING:
    from lmcache_shim_child import _PathBench


# ---- Reference: one Valkey key per object, plain valkey-py client -------------------------------------------


class _PlainValkeyImpl:
    layered = True

    def __init__(self, b: _PathBench) -> None:
        self.b = b
        self.per_layer = b.lay["granularity"] == "per_layer"
        if not self.per_layer:
            self.layered = False

    def describe(self) -> dict[str, Any]:
        import valkey

        return {
            "driven_by": (
                "valkey-py Valkey client, one key per object; lookup = one EXISTS over all keys; restore = "
                + ("one non-transactional pipeline of GETs per layer" if self.per_layer else
                   "one non-transactional pipeline of GETs")
                + ", replies parsed by the client into bytes, then the shim copy"
            ),
            "valkey_py_version": valkey.__version__,
            "valkey_py_parser": valkey.connection.DefaultParser.__name__,
        }

    def setup(self) -> None:
        import valkey

        b = self.b
        host, port = _host_port(b.spec["valkey_url"])
        self.client = valkey.Valkey(host=host, port=port, socket_timeout=b.spec["op_timeout_s"])
        n_chunks = b.T // b.C
        self.keys = []  # [layer][chunk] (per_layer) or [[chunk...]] (per_chunk)
        for layer in range(b.L if self.per_layer else 1):
            self.keys.append([f"{b.tag}:{layer}:{c}" for c in range(n_chunks)])

    def store(self) -> None:
        b = self.b
        n_chunks = b.T // b.C
        for layer, keys in enumerate(self.keys):
            pipe = self.client.pipeline(transaction=False)
            for c in range(n_chunks):
                w0, w1 = b.word_range(c * b.C, (c + 1) * b.C)
                src = b.src_image[layer, w0:w1] if self.per_layer else b.src_image[:, w0:w1].contiguous()
                pipe.set(keys[c], src.numpy().tobytes())
                if len(pipe) >= 64:
                    pipe.execute()
            pipe.execute()

    def lookup(self) -> int:
        allk = [k for ks in self.keys for k in ks]
        n = int(self.client.exists(*allk))
        return self.b.T if n == len(allk) else 0

    def restore(self) -> dict[str, Any]:
        import torch

        b = self.b
        round_trips = 0
        for layer, keys in enumerate(self.keys):
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            vals = pipe.execute()
            round_trips += 1
            pieces = [torch.frombuffer(v, dtype=torch.int64) for v in vals]
            if self.per_layer:
                b.deliver_layer_from_pieces(layer, pieces)
            else:
                b.deliver_all_from_chunk_objects([p.view(b.L, -1) for p in pieces])
        n = sum(len(k) for k in self.keys)
        return {"objects_requested": n, "get_commands_sent": n, "pipelines": round_trips}

    def release(self) -> None:
        pass

    def close(self) -> str:
        self.client.close()
        return "ok"


# ---- Reference: the bytes already resident in memory, one index copy per layer ------------------------------


class _ResidentImpl:
    layered = True

    def __init__(self, b: _PathBench) -> None:
        self.b = b

    def describe(self) -> dict[str, Any]:
        return {"driven_by": "contiguous in-memory copy of the payload ([L, blocks, block bytes]); restore = "
                             "one index_copy_ per layer into the destination blocks (no per-object work)"}

    def setup(self) -> None:
        pass

    def store(self) -> None:
        self.image = self.b.src_image.clone()

    def lookup(self) -> int:
        return self.b.T

    def restore(self) -> dict[str, Any]:
        b = self.b
        img = self.image.view(b.L, b.nb, b.block_words)
        for layer in range(b.L):
            b.scatter_layer(layer, img[layer])
        return {"objects_requested": 0}

    def release(self) -> None:
        pass

    def close(self) -> str:
        return "ok"
