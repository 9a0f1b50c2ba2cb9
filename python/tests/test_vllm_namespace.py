"""The vLLM tier's namespace and directory (`kvxfer.vllm.namespace`, no vLLM): the bytes of
kvxfer 1.4's tier, so a store that tier made is found again after an upgrade."""

from types import SimpleNamespace as N

from kvxfer.vllm import fingerprint, namespace_of, store_directory, store_key
from kvxfer import tier


def offloading_spec():
    """What the fingerprint reads of vLLM's `OffloadingSpec`."""
    config = N(
        model=N(name="org/model", dtype="bfloat16"),
        cache=N(tokens_per_hash=16, blocks_per_chunk=4),
        groups=[N(tokens_per_block=16, layer_names=("l.0", "l.1"))],
        parallel=N(world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1),
        worker_kv_bytes_per_block=65536,
        canonical_layout=True,
        kv_cache_layout="NHD",
    )
    return N(replicated_layout=False, config=config)


def test_the_tier_namespace_and_directory_are_those_of_kvxfer_1_4():
    fields = fingerprint(offloading_spec(), 524288, "rev-1")
    ns = namespace_of(fields)
    assert ns == b"vllm 43f4d1931f4577a5d77ce31854d332226f8d180baea6500effc3af7adce60cfb"
    assert ns == tier.namespace_of("vllm", fields)
    assert store_directory("/r", fields, ns, 1) == "/r/org_model_43f4d1931f45_dp1"


def test_vllm_keys_are_the_shared_store_keys():
    assert store_key is tier.store_key
