"""kvxfer.lmcache without LMCache 0.5.6: the module imports, and the connector LMCache
would make refuses with the version it needs (the plug-in itself is tested against LMCache
in python/integration/test_lmcache_plugin.py)."""

import importlib.metadata

import pytest

import kvxfer
import kvxfer.lmcache as kv_lmcache


@pytest.mark.parametrize("installed", [None, "0.5.5"])
def test_the_connector_refuses_any_lmcache_but_the_supported_one(tmp_path, monkeypatch, installed):
    real = importlib.metadata.version

    def version(name):
        if name != "lmcache":
            return real(name)
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(kvxfer.Unsupported, match=r"LMCache 0\.5\.6") as e:
        kv_lmcache.KvxferConnector(root_dir=str(tmp_path), capacity_bytes=1 << 20)
    assert ("not installed" if installed is None else "LMCache 0.5.5 is installed") in str(e.value)
    assert not list(tmp_path.iterdir()), "nothing made before the refusal"
