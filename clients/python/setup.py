"""Builds moecache_client._shm, the shared-memory hit path, from _shm.pyx and the one C
implementation of its rules, ../c/include/moecache_shm.h, whose Cython declarations it cimports
from ../c/include/moecache_shm.pxd (pip builds in the source tree, so the relative path holds).
Without the extension the client works over the socket only."""
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(ext_modules=cythonize(
    [Extension("moecache_client._shm", ["moecache_client/_shm.pyx"], include_dirs=["../c/include"],
               extra_compile_args=["-O2", "-std=gnu11"])],
    language_level=3, include_path=["../c/include"],
    compiler_directives={"boundscheck": False, "wraparound": False}))
