"""Edge0: run Mixture-of-Experts models bigger than memory on MLX."""

from edge0.version import __version__

__all__ = ["__version__", "load"]


def load(path=None, **options):
    """Load an edge0 store (None = the bundled demo model) and return an Engine.

    `options` are the fields of edge0.options.LoadOptions; see docs/engine-api.md.
    """
    from edge0.options import LoadOptions
    from edge0.runtime import load_engine

    return load_engine(path, LoadOptions(**options))
