"""The vLLM versions kvxfer.vllm implements, and the check that refuses another."""

from __future__ import annotations

from ..tier import check_version

#: The vLLM versions whose offloading interfaces kvxfer.vllm implements.
SUPPORTED_VLLM = ("0.33.0",)


def check_vllm_version() -> str:
    """The installed vLLM's version; raises `Unsupported` naming the supported ones when
    it is another (or when vLLM is not installed)."""
    return check_version("kvxfer.vllm", "vllm", "vLLM", SUPPORTED_VLLM, "tiering interface")
