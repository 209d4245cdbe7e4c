"""Build hook for the one optional C extension; every other setting is in pyproject.toml.

``shardkit._stream_copy`` (non-temporal copies for checkpoint staging) is
optional: without a C compiler the install still succeeds and staging uses
ctypes.memmove instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shardkit._stream_copy",
            sources=["src/shardkit/_stream_copy.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
