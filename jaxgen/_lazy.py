"""Package names imported on first use (PEP 562), so that importing a light module of a package
(the host-side block manager, the typed errors) does not import JAX, Flax or the engine."""

import importlib


def lazy_exports(package: str, names: dict[str, str]):
    """(__getattr__, __all__) for `package`, whose `names` live in the modules they map to."""

    def __getattr__(name):
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, sorted(names)
