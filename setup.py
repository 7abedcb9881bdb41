"""Builds the Cython core: every cython_ext/<wing>/<name>.pyx becomes the module moecached.<wing>.<name>
(the Cython of a wing sits in the folder of its name; files in deeper folders are ``include``d).
The Python client, moecache_client and its shared-memory hit path moecache_client._shm, is its
own distribution (clients/python/setup.py).

``clients/c/include`` is on the C and the Cython include path: the daemon's ``_shm`` module and
the client's compile ``moecache_shm.h``, the one implementation of the shared-memory hit path's
rules, and cimport its declarations from ``moecache_shm.pxd`` beside it.

Modules do not cimport each other (one .pyx per concept, each self-contained), so a plain
`pip install .` needs nothing beyond the build requirements in pyproject.toml.
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

exts = [
    Extension(
        "moecached." + os.path.splitext(os.path.relpath(p, "cython_ext"))[0].replace(os.sep, "."),
        [p],
        include_dirs=[numpy.get_include(), "clients/c/include"],
        extra_compile_args=["-O3"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for p in sorted(glob.glob("cython_ext/*/*.pyx"))
]
setup(ext_modules=cythonize(exts, language_level=3, include_path=["cython_ext", "cython_ext/engine", "clients/c/include"],
                            compiler_directives={"boundscheck": False, "wraparound": False}))
