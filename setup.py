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
  Debian, Ubuntu:          apt-get install libnuma-dev
  RHEL, Fedora, Rocky:     dnf install numactl-devel
  SUSE:                    zypper install libnuma-devel
  Alpine:                  apk add numactl-dev
  conda-forge:             conda install -c conda-forge libnuma
                           (then CPATH=$CONDA_PREFIX/include LIBRARY_PATH=$CONDA_PREFIX/lib)
Installed elsewhere: CFLAGS=-I<prefix>/include LDFLAGS=-L<prefix>/lib.
Or install numafast's binary wheel (manylinux), which bundles libnuma."""

INSTALL_COMPILER = """\
  Debian, Ubuntu:          apt-get install gcc
  RHEL, Fedora, Rocky:     dnf install gcc
  SUSE:                    zypper install gcc
  Alpine:                  apk add gcc musl-dev
Or install numafast's binary wheel (manylinux), which needs no compiler."""


class BuildExtensionWithProbes(build_ext):
    """build_ext that checks for a C compiler, numa.h and libnuma before compiling."""

    def build_extensions(self) -> None:
        # The compiler is set up (CC, CFLAGS, LDFLAGS, --include-dirs) by now.
        include_dirs = [*self.include_dirs, *(d for e in self.extensions for d in e.include_dirs)]
        library_dirs = [*self.library_dirs, *(d for e in self.extensions for d in e.library_dirs)]
        with tempfile.TemporaryDirectory(prefix="numafast-probe-") as tmp:
            steps = [
                ("plain.c", "int numafast_probe(void) { return 0; }\n", False),
                ("header.c", "#include <numa.h>\nint numafast_probe(void) { return numa_available(); }\n", False),
                ("header.c", None, True),
            ]
            for name, source, link in steps:
                failure = self._probe(Path(tmp), name, source, include_dirs, library_dirs, link)
                if failure is None:
                    continue
                if name == "plain.c":
                    what, how = "no working C compiler", INSTALL_COMPILER
                elif not link:
                    what, how = "libnuma's header numa.h was not found", INSTALL_LIBNUMA
                else:
                    what, how = "the library libnuma (-lnuma) was not found", INSTALL_LIBNUMA
                raise SystemExit(
                    f"\nnumafast cannot be built from source here: {what}\n"
                    f"(the compiler said: {failure})\n"
                    f"Install it, then build again:\n{how}\n"
                )
        super().build_extensions()

    def _probe(
        self, tmp: Path, name: str, source: str | None, include_dirs: list[str], library_dirs: list[str], link: bool
    ) -> str | None:
        """None if ``source`` compiles (and, with ``link``, links with -lnuma), else the
        compiler's first error line. Its output is kept off the terminal."""
        log = tmp / f"{name}.{'link' if link else 'compile'}.log"
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            with log.open("w") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                try:
                    if source is not None:
                        (tmp / name).write_text(source)
                        self.compiler.compile([str(tmp / name)], output_dir=str(tmp), include_dirs=include_dirs)
                    if link:
                        objects = self.compiler.object_filenames([str(tmp / name)], output_dir=str(tmp))
                        self.compiler.link_shared_object(
                            objects, str(tmp / "probe.so"), libraries=["numa"], library_dirs=library_dirs
                        )
                    return None
                except Exception as error:  # CompileError, LinkError, a missing compiler (OSError)
                    failure = str(error)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os.dup2(saved[0], 1)
                    os.dup2(saved[1], 2)
        finally:
            os.close(saved[0])
            os.close(saved[1])
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
