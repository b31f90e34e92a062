"""On-disk expert store: manifest (format name + version), streaming writer, mmap reader."""

from edge0.store.format import FORMAT, MANIFEST, VERSION, open_manifest
from edge0.store.reader import ExpertStore

__all__ = ["FORMAT", "MANIFEST", "VERSION", "open_manifest", "ExpertStore"]
