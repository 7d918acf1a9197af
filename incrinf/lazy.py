"""Names of a package that load their module on first use (PEP 562), so importing the package stays light."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    Args:
        package: the package's ``__name__``.
        exports: exported name -> module path to load it from (absolute, or relative to ``package`` when it
            starts with a dot); a module path ending in ``:`` exports the module itself.

    Returns:
        The two module-level hooks; a loaded name is stored in the package, so later lookups skip the hook.
    """
    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_path = where.rstrip(":")
        module = importlib.import_module(module_path, package if module_path.startswith(".") else None)
        value = module if where.endswith(":") else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
