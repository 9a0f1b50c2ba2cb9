"""kvxfer for vLLM's KV offloading (vLLM 0.33.0, `SUPPORTED_VLLM`); see docs/vllm.md.

- `KvxferTier`: a secondary tier of vLLM's tiered offloading (module `tier`), loaded by
  `"module_path": "kvxfer.vllm"`.

`import kvxfer.vllm` needs no vLLM: each class is made, and vLLM imported and its version
checked, when it is first asked for."""

from __future__ import annotations

from typing import Any, Dict, Sequence

from .namespace import fingerprint, namespace_of, store_directory, store_key
from .tier import chunk_layout
from .version import SUPPORTED_VLLM, check_vllm_version

#: The classes vLLM asks for by name, made on first use.
_made: Dict[str, type] = {}


def __getattr__(name: str) -> Any:
    """`KvxferTier`, made on first use, so `import kvxfer.vllm` needs no vLLM."""
    if name not in _made:
        if name == "KvxferTier":
            from .tier import make_tier_class

            _made[name] = make_tier_class()
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _made[name]


__all__: Sequence[str] = ["KvxferTier", "SUPPORTED_VLLM", "check_vllm_version", "chunk_layout", "fingerprint", "namespace_of", "store_key", "store_directory"]
