"""Hash constructors for the load and request paths that keep OpenSSL out of the process.

`import hashlib` imports `_hashlib`, which maps OpenSSL's libcrypto: ~3.3 MB resident in a
process whose RSS bound (SmolLM2: 1.5 x the file + the KV cache) leaves the runtime ~47 MB. The
prefix cache's block keys and the short config digests need only CPython's own blake2b and
sha256, which give the same digests. Bulk data (a model file, a session's checksum, an NPU
graph's weights) goes through bulk_sha256(), which imports hashlib when first called: OpenSSL's
sha256 is several times faster on tens of megabytes."""
try:
    from _blake2 import blake2b
except ImportError:  # a CPython built without its blake2 module
    from hashlib import blake2b

try:
    from _sha256 import sha256          # CPython <= 3.11
except ImportError:
    try:
        from _sha2 import sha256        # CPython >= 3.12
    except ImportError:
        from hashlib import sha256


def bulk_sha256(data: bytes = b""):
    """A sha256 object for megabytes of data: OpenSSL's, imported on first use."""
    import hashlib

    return hashlib.sha256(data)


def file_sha256(path, progress=None) -> str:
    """Hex sha256 of a whole file, read in 4 MiB blocks; progress(done, total) after each."""
    import os

    h = bulk_sha256()
    total, done = os.stat(path).st_size, 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
            done += len(block)
            if progress:
                progress(done, total)
    return h.hexdigest()


__all__ = ["blake2b", "bulk_sha256", "file_sha256", "sha256"]
