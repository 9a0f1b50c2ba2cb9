"""The vLLM versions kvxfer.vllm implements, and the check that refuses another."""

from __future__ import annotations

from ..errors import Unsupported

#: The vLLM versions whose offloading interfaces kvxfer.vllm implements.
SUPPORTED_VLLM = ("0.33.0",)


def check_vllm_version() -> str:
    """The installed vLLM's version; raises `Unsupported` naming the supported ones when
    it is another (or when vLLM is not installed)."""
    from importlib import metadata

    try:
        v = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        raise Unsupported(f"kvxfer.vllm needs vLLM {' or '.join(SUPPORTED_VLLM)}; vLLM is not installed (pip install vllm=={SUPPORTED_VLLM[-1]})", 5) from None
    if v not in SUPPORTED_VLLM:
        raise Unsupported(
            f"kvxfer.vllm supports vLLM {' or '.join(SUPPORTED_VLLM)}, whose tiering interface it implements; "
            f"vLLM {v} is installed: install vllm=={SUPPORTED_VLLM[-1]}, or a kvxfer that supports {v}",
            5,
        )
    return v
