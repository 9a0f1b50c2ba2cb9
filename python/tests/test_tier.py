"""kvxfer.tier: namespaces, store keys, chunk layouts and the runtime version check, shared
by the runtime plug-ins."""

import hashlib
import zlib

import pytest

import kvxfer
from kvxfer.tier import DISK_BOUNCE_BYTES, DISK_IO_THREADS, MAX_REGION, check_version, chunk_layout, engine_settings, make_root, namespace_of, open_or_remake, shared_tier, store_key


def test_a_namespace_is_the_kind_and_a_digest_of_every_field():
    a = namespace_of("lmcache", {"model": "m", "dtype": "bf16"})
    assert a == namespace_of("lmcache", {"dtype": "bf16", "model": "m"}), "field order does not matter"
    assert a.startswith(b"lmcache ") and len(a) == len(b"lmcache ") + 64
    assert a != namespace_of("lmcache", {"model": "m", "dtype": "fp8"})
    assert a != namespace_of("vllm", {"model": "m", "dtype": "bf16"})


def test_a_key_of_64_bytes_or_more_is_its_digest():
    assert store_key(b"k" * 63) == b"k" * 63
    long = store_key(b"k" * 65)
    assert len(long) == 64 and long != store_key(b"k" * 66)
    assert len(store_key(b"k" * 64)) == 64 and store_key(b"k" * 64) != b"k" * 64


def test_no_two_keys_share_a_store_key():
    """A long key's digest is itself a legal key: the two must not name one entry."""
    long = b"k" * 65
    assert store_key(long) != store_key(hashlib.blake2b(long, digest_size=64).digest())
    assert store_key(store_key(long)) != store_key(long)


def test_a_chunk_is_one_block_of_equal_regions_of_at_most_256_kib():
    for chunk in (1000, MAX_REGION, 4096 * 3 * 67, 32 << 20, 3 * 5 * 7 * 11 * 13 * 17 * 19):
        c = chunk_layout(2, chunk)
        region = c.inner_dim
        assert c.block_bytes == chunk and c.num_blocks == 2 and region <= max(chunk, 1) and chunk % region == 0
        assert region <= MAX_REGION or chunk <= MAX_REGION
        if chunk % 4096 == 0 and chunk > MAX_REGION:
            assert region % 4096 == 0
    assert chunk_layout(1, 32 << 20).inner_dim == MAX_REGION
    assert isinstance(chunk_layout(1, 10), kvxfer.LayoutConfig)


def test_a_store_off_the_page_cache_gets_a_deep_disk_queue_unless_the_user_sets_one():
    deep = engine_settings(None, buffered=False)
    assert deep == {"io_threads": DISK_IO_THREADS, "bounce_bytes": DISK_BOUNCE_BYTES}
    assert engine_settings({"io_threads": 2}, buffered=False)["io_threads"] == 2, "the user's setting stands"
    assert engine_settings({"slot_bytes": 64 << 20}, buffered=False)["bounce_bytes"] == 256 << 20, "four slots at least"
    assert engine_settings({"io_backend": "posix"}, buffered=True) == {"io_backend": "posix"}, "page-cache copies keep the defaults"
    with kvxfer.Engine("emulated", **deep) as e:
        assert e.config().io_threads == DISK_IO_THREADS


def another_version(directory):
    """Rewrites the store's `meta` as a store version past this library's (its version
    word, then its checksum)."""
    meta = directory / "meta"
    m = bytearray(meta.read_bytes())
    m[8:12] = (int.from_bytes(m[8:12], "little") + 1).to_bytes(4, "little")
    m[-4:] = zlib.crc32(m[:-4]).to_bytes(4, "little")
    meta.write_bytes(bytes(m))


def damaged(directory):
    """Flips a byte of the store's `meta`: its checksum no longer matches."""
    meta = directory / "meta"
    m = bytearray(meta.read_bytes())
    m[20] ^= 0x40
    meta.write_bytes(bytes(m))


@pytest.mark.parametrize("made", ["another version", "another geometry", "another capacity", "damaged"])
def test_a_store_made_otherwise_is_made_afresh_with_a_warning(tmp_path, caplog, made):
    d = tmp_path / "store"
    with kvxfer.Engine("emulated") as e:
        kvxfer.Store(e, d, chunk_layout(1, 4096), 4, namespace=b"t").close()
        if made == "another version":
            another_version(d)
        if made == "damaged":
            damaged(d)
        config, capacity = (chunk_layout(1, 8192 if made == "another geometry" else 4096), 8 if made == "another capacity" else 4)
        with pytest.raises((kvxfer.VersionError, kvxfer.Incompatible, kvxfer.IntegrityError)):
            kvxfer.Store(e, d, config, capacity, namespace=b"t").close()
        with caplog.at_level("WARNING", logger="kvxfer.tier"):
            with open_or_remake(lambda: kvxfer.Store(e, d, config, capacity, namespace=b"t"), str(d), "test tier") as s:
                assert s.stats().capacity == capacity and s.stats().entries == 0
        (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.tier"]
        assert line.startswith("test tier: ") and "afresh" in line


def test_a_root_dir_that_cannot_be_made_or_written_is_refused(tmp_path):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(kvxfer.InvalidArgument, match="cannot be made"):
        make_root(str(tmp_path / "file" / "kv"), "test tier")
    assert make_root(str(tmp_path / "new" / "kv"), "test tier") == str(tmp_path / "new" / "kv")
    assert (tmp_path / "new" / "kv").is_dir()


def test_a_plugins_shared_setting_names_one_place_and_is_refused_otherwise():
    assert shared_tier("p", None) is None
    d = shared_tier("p", {"dir": "/mnt/kv", "capacity_bytes": 1 << 40, "write": "through", "timeout": 2.5})
    assert (d.kind, d.path, d.capacity_bytes, d.write, d.timeout) == ("dir", "/mnt/kv", 1 << 40, "through", 2.5)
    b = shared_tier("p", {"s3_bucket": "kv", "s3_prefix": "m/", "s3_endpoint": "http://127.0.0.1:9000", "admit": False})
    assert (b.kind, b.bucket, b.prefix, b.endpoint, b.admit) == ("s3", "kv", "m/", "http://127.0.0.1:9000", False)
    for bad, says in [
        ("/mnt/kv", "give a mapping"),
        ({"dir": "/a", "s3_bucket": "b"}, "names one place"),
        ({"write": "through"}, "names one place"),
        ({"dir": "/a", "bucket": "b"}, "unknown"),
        ({"s3_bucket": "b", "capacity_bytes": 5}, "lifecycle"),
    ]:
        with pytest.raises(kvxfer.InvalidArgument, match=says):
            shared_tier("the plug-in", bad)


def check_runtimex():
    return check_version("kvxfer.runtimex", "runtimex", "RuntimeX", ("1.4.0", "1.5.0"), "storage interface")


@pytest.mark.parametrize("opt_in", [None, "0", "yes"])
def test_a_runtime_release_outside_the_tested_ones_is_refused_naming_them_and_the_opt_in(monkeypatch, installed, opt_in):
    installed("runtimex", "1.6.0")
    if opt_in is None:
        monkeypatch.delenv("KVX_RUNTIMEX_ANY_VERSION", raising=False)
    else:
        monkeypatch.setenv("KVX_RUNTIMEX_ANY_VERSION", opt_in)
    with pytest.raises(kvxfer.Unsupported) as e:
        check_runtimex()
    says = str(e.value)
    assert "supports RuntimeX 1.4.0 or 1.5.0" in says and "RuntimeX 1.6.0 is installed" in says
    assert "install runtimex==1.5.0" in says and "set KVX_RUNTIMEX_ANY_VERSION=1 to run it untested" in says


def test_a_tested_runtime_release_passes_without_a_word(monkeypatch, installed, caplog):
    installed("runtimex", "1.4.0")
    monkeypatch.delenv("KVX_RUNTIMEX_ANY_VERSION", raising=False)
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        assert check_runtimex() == "1.4.0"
    assert not caplog.records


def test_the_opt_in_runs_an_untested_release_with_a_warning_naming_the_tested_ones(monkeypatch, installed, caplog):
    installed("runtimex", "1.6.0")
    monkeypatch.setenv("KVX_RUNTIMEX_ANY_VERSION", "1")
    with caplog.at_level("WARNING", logger="kvxfer.tier"):
        assert check_runtimex() == "1.6.0"
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvxfer.tier"]
    assert "RuntimeX 1.4.0 or 1.5.0" in line and "RuntimeX 1.6.0 is installed and runs untested (KVX_RUNTIMEX_ANY_VERSION=1)" in line


def test_the_opt_in_does_not_stand_for_a_runtime_not_installed(monkeypatch, installed):
    installed("runtimex", None)
    monkeypatch.setenv("KVX_RUNTIMEX_ANY_VERSION", "1")
    with pytest.raises(kvxfer.Unsupported, match=r"needs RuntimeX 1\.4\.0 or 1\.5\.0; RuntimeX is not installed \(pip install runtimex==1\.5\.0\)"):
        check_runtimex()
