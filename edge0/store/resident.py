"""The resident weights checked while they load: `model.safetensors` is read once more on a
background thread and hashed while the backend loads it, so damage is an error at load, never text
computed from damaged weights. The hash is the manifest's `resident_crc32` (cheaper, measured in
docs/store-format.md, "Integrity"), or the file's sha256 in stores converted before it existed."""

from __future__ import annotations

import hashlib
import threading
import zlib
from pathlib import Path

from edge0.errors import Edge0Error
from edge0.store.format import RESIDENT_FILE

PIECE = 8 << 20  # bytes hashed per read; the hash releases the GIL on pieces this large


class Crc32:
    """zlib's crc32 behind hashlib's interface (update, hexdigest)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class ResidentCheck:
    """Hashes one file on a background thread; `result()` waits and raises on a mismatch."""

    def __init__(self, path: Path, expected: str, hasher=hashlib.sha256, name: str = "sha256"):
        """`hasher()` makes an object with update() and hexdigest() (hashlib's interface)."""
        self.path, self.expected, self.hasher, self.name = Path(path), expected, hasher, name
        self.found: str | None = None
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, name="edge0-resident-check", daemon=True)

    def start(self) -> "ResidentCheck":
        self.thread.start()
        return self

    def _run(self) -> None:
        h = self.hasher()
        buf = bytearray(PIECE)
        view = memoryview(buf)
        try:
            with open(self.path, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    h.update(view[:n])
        except OSError as e:
            self.error = e
            return
        self.found = h.hexdigest()

    def result(self) -> None:
        """Wait for the hash; an Edge0Error naming the file and `edge0 verify` if it differs."""
        self.thread.join()
        if self.error is not None:
            raise Edge0Error(f"{self.path}: cannot be read to check it ({self.error.strerror})")
        if self.found != self.expected:
            root = self.path.parent
            raise Edge0Error(
                f"{self.path} does not match its checksum ({self.name} differs from the manifest): the store's "
                f"resident weights are damaged; find every damaged file with: edge0 verify {root}"
            )


def check_resident(root, manifest: dict) -> ResidentCheck | None:
    """Start checking `root`'s resident weights against the manifest: its crc32, else the file's
    sha256 (stores converted before the crc32 was written); None if it has neither."""
    path = Path(root) / RESIDENT_FILE
    if manifest.get("resident_crc32") is not None:
        return ResidentCheck(path, f"{int(manifest['resident_crc32']):08x}", Crc32, "crc32").start()
    expected = (manifest.get("files") or {}).get(RESIDENT_FILE, {}).get("sha256")
    return ResidentCheck(path, expected).start() if expected else None
