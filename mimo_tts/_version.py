"""The package's version, its one home: the wheel's metadata, `--version`, sidecars and Wyoming's
`info` read it here (no other import, so every layer may)."""

__version__ = "0.1.0"
