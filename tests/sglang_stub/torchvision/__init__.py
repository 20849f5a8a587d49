"""Stub for tests: SGLang imports torchvision unconditionally; no torchvision matches CPU torch."""
import sys, types
__version__ = "0.0.1"

class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything

class _Anything(metaclass=_Meta):
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return self

class _Mod(types.ModuleType):
    __path__: list = []
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything

for sub in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "transforms.InterpolationMode", "io", "ops", "models", "utils", "datasets"):
    sys.modules[f"torchvision.{sub}"] = _Mod(f"torchvision.{sub}")
def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return sys.modules.get(f"torchvision.{name}", _Anything)
