"""A stand-in torchvision for importing SGLang's worker modules on CPU in the tests.

SGLang imports torchvision unconditionally (its multimodal configs), and no torchvision wheel
matches the CPU build of torch (PyPI's fails with ``operator torchvision::nms does not exist``).
Only child processes of ``tests/test_sglang_plugin.py`` see this package (on ``PYTHONPATH``); every
attribute is a dummy that can be subclassed, called or looked up further.
"""

import sys
import types

__version__ = "0.0.1"


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


class _Anything(metaclass=_Meta):
    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return self


class _Module(types.ModuleType):
    __path__: list = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything


for _sub in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional",
             "transforms.InterpolationMode", "io", "ops", "models", "utils", "datasets"):
    sys.modules[f"torchvision.{_sub}"] = _Module(f"torchvision.{_sub}")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return sys.modules.get(f"torchvision.{name}", _Anything)
