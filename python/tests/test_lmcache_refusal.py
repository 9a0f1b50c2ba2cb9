"""kvxfer.lmcache without a supported LMCache: the module imports, and the connector
LMCache would make refuses naming the versions it is tested with, unless the user opts in
(the plug-in itself is tested against LMCache in python/integration/test_lmcache_plugin.py)."""

import pytest

import kvxfer
import kvxfer.lmcache as kv_lmcache


@pytest.mark.parametrize("version", [None, "0.5.4", "0.5.7"])
def test_the_connector_refuses_any_lmcache_but_the_supported_ones(tmp_path, monkeypatch, installed, version):
    installed("lmcache", version)
    monkeypatch.delenv("KVX_LMCACHE_ANY_VERSION", raising=False)
    with pytest.raises(kvxfer.Unsupported, match=r"LMCache 0\.5\.5 or 0\.5\.6") as e:
        kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20)
    assert ("not installed" if version is None else f"LMCache {version} is installed") in str(e.value)
    assert version is None or "KVX_LMCACHE_ANY_VERSION=1" in str(e.value)
    assert not list(tmp_path.iterdir()), "nothing made before the refusal"


def test_the_opt_in_makes_the_connector_over_another_lmcache_with_a_warning(tmp_path, monkeypatch, installed, caplog):
    installed("lmcache", "0.5.7")
    monkeypatch.setenv("KVX_LMCACHE_ANY_VERSION", "1")
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20).close()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.tier"]
    assert line.startswith("kvxfer.lmcache is tested with LMCache 0.5.5 or 0.5.6; LMCache 0.5.7 is installed")
