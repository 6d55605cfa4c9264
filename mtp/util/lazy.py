"""A package's public names, imported only when first used, so that importing the package (and
every `mtp ... --help`) loads neither torch nor Lightning."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """The module-level `__getattr__` and `__dir__` of `package`, which names each of `exports`
    (public name -> the module that defines it) and imports that module on first use."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
