"""``range_connector.lmcache``'s Range half imports without vLLM (and without LMCache), and its parameters are
checked with errors that name the key.

The adapter module itself subclasses LMCache's interface, so it is imported (with vLLM blocked the same way) by
``tests/lmcache/test_l2_adapter.py`` inside LMCache's environment.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from range_connector.errors import ConfigError
from range_connector.lmcache.config import RangeL2Config

ROOT = Path(__file__).resolve().parents[2]

#: run in a fresh interpreter: any import of vllm or lmcache raises, then the Range half is imported and used
_BLOCKED_IMPORT = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("vllm", "lmcache"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
try:
    import vllm
except ImportError:
    pass
else:
    raise SystemExit("the block did not work")
import range_connector.lmcache
from range_connector.lmcache.config import RangeL2Config
from range_connector.lmcache.objects import ObjectStore, object_id
from range_connector.backends.memory import MemoryBackend

store = ObjectStore([MemoryBackend(None)], lease_ttl_s=5.0)
oid = object_id("m", 0, 0, b"h" * 32, "")
assert store.store([oid], [memoryview(b"abc")]).stored == [True]
dest = bytearray(3)
assert store.load([oid], [memoryview(dest)]) == [True] and dest == b"abc"
store.close()
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "lmcache"))
assert not bad, bad
print("ok")
"""


@pytest.mark.timeout(120)
def test_the_range_half_imports_and_runs_without_vllm_or_lmcache() -> None:
    r = subprocess.run([sys.executable, "-c", _BLOCKED_IMPORT], capture_output=True, text=True, timeout=110,
                       cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


@pytest.mark.timeout(10)
def test_parameters_default_to_one_valkey_shard_per_server() -> None:
    c = RangeL2Config.from_params({"servers": ["valkey://h:1", "valkey://h:2"], "capacity_bytes": 1 << 30})
    assert (c.type, c.num_shards, c.capacity_bytes, c.deployment, c.lease_ttl_s) == ("valkey", 2, 1 << 30,
                                                                                      "lmcache", 60.0)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("params", "key"), [
    ({"servers": ["valkey://h:1"], "capacity_gb": 1}, "adapter_params.capacity_gb"),
    ({"type": "valkey"}, "adapter_params.servers"),
    ({"type": "s3"}, "adapter_params.type"),
    ({"type": "file"}, "adapter_params.directory"),
    ({"type": "memory", "servers": ["valkey://h:1"]}, "adapter_params.servers"),
    ({"servers": ["valkey://h:1"], "num_shards": 2}, "adapter_params.num_shards"),
    ({"servers": ["valkey://h:1"], "capacity_bytes": -1}, "adapter_params.capacity_bytes"),
    ({"servers": ["valkey://h:1"], "lease_ttl_s": 0}, "adapter_params.lease_ttl_s"),
    ({"servers": ["valkey://h:1"], "deployment": "a:b"}, "adapter_params.deployment"),
])
def test_a_bad_parameter_is_a_config_error_naming_it(params: dict, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        RangeL2Config.from_params(params)
    assert info.value.key == key


@pytest.mark.timeout(10)
def test_an_object_ticket_is_bounds_checked_like_every_ticket() -> None:
    from range_connector.kv.tickets import Ticket

    good = Ticket("abc123", 100, 50, 4096, 1, 1, 1, (7,))
    assert Ticket.decode_object(good.encode()) == good
    poisoned = [
        Ticket("abc123", 4090, 50, 4096, 1, 1, 1, (7,)),  # past its stripe's end
        Ticket("abc123", 0, 50, 4096, 2, 1, 1, (7, 8)),  # two layers: a KV chunk's ticket, not an object's
        Ticket("abc123", 0, 50, 4096, 1, 1, 2, (7,)),  # two-byte rows
        Ticket("abc123", 0, 0, 4096, 1, 1, 1, (7,)),  # empty
        Ticket("abc123", 0, 50, 1 << 40, 1, 1, 1, (7,)),  # a stripe over the tier's limit
    ]
    assert [Ticket.decode_object(t.encode(), max_layer_bytes=1 << 30) for t in poisoned] == [None] * 5
    assert Ticket.decode_object(b"\xc1garbage") is None and Ticket.decode_object(None) is None
