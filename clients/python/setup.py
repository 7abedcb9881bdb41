"""Builds moecache_client._shm, the shared-memory hit path, from _shm.pyx and the one C
implementation of its rules, ../c/include/moecache_shm.h, whose Cython declarations it cimports
from ../c/include/moecache_shm.pxd (pip builds in the source tree, so the relative path holds).

The extension is optional: without Cython (``pip install --no-build-isolation`` in an
environment that lacks it) or when it does not compile, the client is installed without it and
works over the socket only. The build then prints one line saying so and how to get the fast path
(pip shows build output with ``-v``); the client itself logs the same note once, at the first
``Client`` that could have used it."""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FAST_PATH_OFF = ("moecache-client: shared-memory fast path OFF ({why}); the client works over the socket only. "
                 "To build it: pip install 'Cython>=3.0' && pip install --no-build-isolation --force-reinstall "
                 "./clients/python")


def note(why: str) -> None:
    print(FAST_PATH_OFF.format(why=why), file=sys.stderr, flush=True)


class optional_build_ext(build_ext):
    """A compile or link failure leaves the extension out, with the note, instead of failing the install."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:   # CompileError, LinkError, no compiler at all (PlatformError, OSError)
            note(f"{ext.name} did not compile: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


try:
    from Cython.Build import cythonize
except ImportError:
    note("Cython is not installed")
    ext_modules = []
else:
    ext_modules = cythonize(
        [Extension("moecache_client._shm", ["moecache_client/_shm.pyx"], include_dirs=["../c/include"],
                   extra_compile_args=["-O2", "-std=gnu11"])],
        language_level=3, include_path=["../c/include"],
        compiler_directives={"boundscheck": False, "wraparound": False})

setup(ext_modules=ext_modules, cmdclass={"build_ext": optional_build_ext})
