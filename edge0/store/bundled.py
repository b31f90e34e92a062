"""Where models come from: a store directory, or (with no path) the bundled demo model, which is
converted into the user cache on first use."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.convert import convert
from edge0.store.format import CONFIG_FILE, FORMAT, MANIFEST, VERSION

BUNDLED_NAME = "edge0-demo-moe"
CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


def cache_dir() -> Path:
    """$EDGE0_CACHE, else $XDG_CACHE_HOME/edge0, else ~/.cache/edge0."""
    if os.environ.get("EDGE0_CACHE"):
        return Path(os.environ["EDGE0_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "edge0"


def bundled_checkpoint() -> Path:
    path = CHECKPOINTS / BUNDLED_NAME
    if not (path / CONFIG_FILE).is_file():
        raise Edge0Error(
            f"no --model given and the bundled model is missing ({path}); install edge0 from a "
            "source checkout with `pip install -e .`, or pass --model <store dir>"
        )
    return path


def _fingerprint(checkpoint: Path) -> str:
    """Changes whenever a checkpoint file is replaced (names, sizes and modification times: a
    retrained adapter keeps its size) or the store format changes, so the store is re-converted;
    stat only, no reading at start-up."""
    h = hashlib.sha256(f"{FORMAT}:{VERSION}".encode())
    for f in sorted(checkpoint.iterdir()):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def bundled_store() -> Path:
    """The bundled model's store in the user cache, converted on first use."""
    checkpoint = bundled_checkpoint()
    store = cache_dir() / "stores" / f"{BUNDLED_NAME}-{_fingerprint(checkpoint)}"
    if not (store / MANIFEST).is_file():
        print(f"edge0: first use of the bundled model: converting {checkpoint} into {store}", file=sys.stderr)
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise Edge0Error(
                f"{store.parent}: cannot create the model cache ({e.strerror}); set EDGE0_CACHE to a writable directory"
            ) from None
        # Processes starting at once share one conversion: the others wait for it and use its store.
        convert(str(checkpoint), store, reuse=True)
    return store


def resolve_model(path) -> Path:
    """The store directory to load. `None` means the bundled demo model."""
    if path is None:
        return bundled_store()
    return Path(path).expanduser()
