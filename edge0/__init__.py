"""Edge0: run Mixture-of-Experts models bigger than memory on MLX."""

__version__ = "0.1.0"


def load(path=None, **options):
    """Load an edge0 store (None = the bundled demo model) and return an Engine.

    See docs/engine-api.md for the options and the Engine interface.
    """
    from edge0.engine import load as _load

    return _load(path, **options)
