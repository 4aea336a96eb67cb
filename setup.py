"""Build numafast's one extension module, numafast._libnuma, linked directly to libnuma.

Before compiling, three tiny probes (a C file, one including numa.h, one linked
with -lnuma) check that the compiler, libnuma's header and the library itself
are there, so that a machine without them stops with one message naming the
package to install, not with a compiler error.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

INSTALL_LIBNUMA = """\
Install libnuma's development files, then build again:
  Debian, Ubuntu:          apt-get install libnuma-dev
  RHEL, Fedora, Rocky:     dnf install numactl-devel
  SUSE:                    zypper install libnuma-devel
  Alpine:                  apk add numactl-dev
  conda-forge:             conda install -c conda-forge libnuma
                           (then CPATH=$CONDA_PREFIX/include LIBRARY_PATH=$CONDA_PREFIX/lib)
Installed elsewhere: CFLAGS=-I<prefix>/include LDFLAGS=-L<prefix>/lib.
Or install numafast's binary wheel (manylinux), which bundles libnuma."""

INSTALL_COMPILER = """\
Install a C compiler, then build again:
  Debian, Ubuntu:          apt-get install gcc
  RHEL, Fedora, Rocky:     dnf install gcc
  SUSE:                    zypper install gcc
  Alpine:                  apk add gcc musl-dev
Or install numafast's binary wheel (manylinux), which needs no compiler."""


USES_LIBNUMA = "#include <numa.h>\nint numafast_probe(void) { return numa_available(); }\n"
# In order: what is missing when the probe fails, its C source, whether it links
# with -lnuma, and how to install what is missing.
PROBES = (
    ("no working C compiler", "int numafast_probe(void) { return 0; }\n", False, INSTALL_COMPILER),
    ("libnuma's header numa.h was not found", USES_LIBNUMA, False, INSTALL_LIBNUMA),
    ("the library libnuma (-lnuma) was not found", USES_LIBNUMA, True, INSTALL_LIBNUMA),
)


class BuildExtensionWithProbes(build_ext):
    """build_ext that checks for a C compiler, numa.h and libnuma before compiling."""

    def build_extensions(self) -> None:
        # The compiler is set up (CC, CFLAGS, LDFLAGS, --include-dirs) by now.
        with tempfile.TemporaryDirectory(prefix="numafast-probe-") as tmp:
            for index, (what, source, link, how) in enumerate(PROBES):
                failure = self._probe(Path(tmp) / f"probe{index}.c", source, link)
                if failure is not None:
                    raise SystemExit(
                        f"\nnumafast cannot be built from source here: {what}\n"
                        f"(the compiler said: {failure})\n{how}\n"
                    )
        super().build_extensions()

    def _probe(self, path: Path, source: str, link: bool) -> str | None:
        """None if ``source`` compiles (and, with ``link``, links with -lnuma), else the
        compiler's first error line. Its output is kept off the terminal."""
        include_dirs = [*self.include_dirs, *(d for e in self.extensions for d in e.include_dirs)]
        library_dirs = [*self.library_dirs, *(d for e in self.extensions for d in e.library_dirs)]
        path.write_text(source)
        log = path.with_suffix(".log")
        failure = None
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            with log.open("w") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                objects = self.compiler.compile([str(path)], output_dir=str(path.parent), include_dirs=include_dirs)
                if link:
                    self.compiler.link_shared_object(
                        objects, str(path.with_suffix(".so")), libraries=["numa"], library_dirs=library_dirs
                    )
        except Exception as error:  # CompileError, LinkError, a missing compiler (OSError)
            failure = str(error)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        if failure is None:
            return None
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
        errors = [line for line in lines if any(w in line for w in ("error:", "cannot find", "No such file"))]
        return errors[0] if errors else failure


extension = Extension(
    "numafast._libnuma",
    sources=["src/_libnuma.pyx"],
    # The files the .pyx includes: rebuilt when they change, shipped in the sdist.
    depends=sorted(str(path) for pattern in ("*.pyx", "*.pxi", "*.pxd") for path in Path("src").glob(pattern)),
    libraries=["numa"],
    extra_compile_args=["-O2"],
)

setup(
    cmdclass={"build_ext": BuildExtensionWithProbes},
    ext_modules=cythonize(
        [extension],
        include_path=["src"],
        compiler_directives={"language_level": "3", "embedsignature": True},
    ),
)
