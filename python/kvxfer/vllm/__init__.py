"""kvxfer for vLLM's KV offloading (vLLM 0.33.0, `SUPPORTED_VLLM`); see docs/vllm.md.

- `KvxferTier`: a secondary tier of vLLM's tiered offloading (module `tier`), loaded by
  `"module_path": "kvxfer.vllm"`.
- `KvxferOffloadingSpec`: an offloading spec of vLLM's OffloadingConnector that moves
  blocks between GPU memory and kvxfer stores directly (module `spec`; its workers' data
  path, which needs torch but not vLLM, is `slot_mover`), loaded by `"spec_module_path":
  "kvxfer.vllm"`.

vLLM's `vllm.general_plugins` entry point, `kvxfer_vllm_plugin.register` (a module beside
this package), registers both by name, so that vLLM finds them without a module path.

`import kvxfer.vllm` needs no vLLM: each class is made, and vLLM imported and its version
checked, when it is first asked for."""

from __future__ import annotations

from typing import Any, Dict, Sequence

from ..tier import chunk_layout, store_key
from .namespace import fingerprint, namespace_of, store_directory
from .version import SUPPORTED_VLLM, check_vllm_version

#: The classes vLLM asks for by name, made on first use.
_made: Dict[str, type] = {}

#: The classes `spec.make_spec_classes` makes (vLLM unpickles `KvxferSlots`, the job
#: specs it ships from the scheduler to the workers, by this module and name).
_SPEC_CLASSES = ("KvxferOffloadingSpec", "KvxferSlots", "KvxferOffloadingManager", "KvxferOffloadingWorker")


def __getattr__(name: str) -> Any:
    """`KvxferTier`, `KvxferOffloadingSpec` and the spec's classes, made on first use, so
    `import kvxfer.vllm` needs no vLLM."""
    if name not in _made:
        if name == "KvxferTier":
            from .tier import make_tier_class

            _made[name] = make_tier_class()
        elif name in _SPEC_CLASSES:
            from .spec import make_spec_classes

            _made.update(make_spec_classes())
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _made[name]


__all__: Sequence[str] = ["KvxferTier", "KvxferOffloadingSpec", "SUPPORTED_VLLM", "check_vllm_version", "chunk_layout", "fingerprint", "namespace_of", "store_key", "store_directory"]
