"""Build numafast's one extension module, numafast._libnuma, linked directly to libnuma."""

from Cython.Build import cythonize
from setuptools import Extension, setup

extension = Extension(
    "numafast._libnuma",
    sources=["src/_libnuma.pyx"],
    libraries=["numa"],
    extra_compile_args=["-O2"],
)

setup(
    ext_modules=cythonize(
        [extension],
        include_path=["src"],
        compiler_directives={"language_level": "3", "embedsignature": True},
    ),
)
