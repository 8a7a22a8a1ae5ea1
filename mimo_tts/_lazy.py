"""Lazy package attributes: a name is imported on first use."""


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module `__getattr__`: each name in `exports` (name -> defining module) is
    imported on first use, so importing the package itself stays cheap."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        return getattr(importlib.import_module(exports[name]), name)

    return __getattr__
