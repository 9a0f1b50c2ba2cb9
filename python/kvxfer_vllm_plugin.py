"""kvxfer's entry point in vLLM's `vllm.general_plugins` group, which vLLM calls in every
process it starts: with kvxfer configured for vLLM (`KVX_VLLM=1` in the environment,
which vLLM's processes inherit), it registers `KvxferOffloadingSpec` and `KvxferTier` with
vLLM's factories, so a config names them without `spec_module_path` / `module_path`.
Without it, it does nothing. A module of its own beside the `kvxfer` package, so that
vLLM loading it imports no kvxfer (nor its library). It never fails vLLM's start: a
registration that fails is a warning, and the module paths still work."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvxfer.vllm")

#: The environment variable that turns the registration on ("1"; unset or "0": off).
ENV = "KVX_VLLM"


def configured() -> bool:
    """Whether this process's environment asks for kvxfer in vLLM."""
    return os.environ.get(ENV, "0") not in ("", "0")


def register() -> None:
    """Registers kvxfer's spec and tier by name with vLLM's factories (lazily: their
    module, kvxfer.vllm, is imported when vLLM first asks for one); a name registered
    already is left as it is."""
    if not configured():
        return
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

        for add, name in ((OffloadingSpecFactory.register_spec, "KvxferOffloadingSpec"), (SecondaryTierFactory.register_tier, "KvxferTier")):
            try:
                add(name, "kvxfer.vllm", name)
            except ValueError:
                log.debug("kvxfer: %s is registered with vLLM already", name)
    except Exception as e:  # vLLM must start whatever happens here
        log.warning("kvxfer: could not register KvxferOffloadingSpec and KvxferTier with vLLM (%s: %s); name them with their module path, kvxfer.vllm", type(e).__name__, e)
