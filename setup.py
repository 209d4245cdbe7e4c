"""Build hook for the one optional C extension; every other setting is in pyproject.toml.

``shardkit._stream_copy`` (non-temporal copies for checkpoint staging, and
an xxh3 hasher that copies and hashes in one pass, on xxHash vendored in
``third_party/xxhash``) is optional: without a C compiler the
install still succeeds, staging uses ctypes.memmove and hashing the
``xxhash`` package.
"""

import platform

from setuptools import Extension, setup

XXHASH = "third_party/xxhash"
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

setup(
    ext_modules=[
        Extension(
            "shardkit._stream_copy",
            # xxHash's run-time AVX2/SSE2 dispatch exists for x86 only; elsewhere its default code path is used.
            sources=["src/shardkit/_stream_copy.c", "src/shardkit/_xxh3_hasher.c", "src/shardkit/_direct_writer.c",
                     "src/shardkit/_direct_writer_type.c"]
            + ([f"{XXHASH}/xxh_x86dispatch.c"] if X86 else []),
            include_dirs=["src/shardkit", XXHASH],
            depends=["src/shardkit/_stream_copy.h", f"{XXHASH}/xxhash.h", f"{XXHASH}/xxh_x86dispatch.h"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
