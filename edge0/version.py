"""The package version (here, not in edge0/__init__.py, so low layers can read it)."""

__version__ = "0.1.0"
