"""Compile ``qmm.c`` (with its header ``qmm_tiles.h``), ``ops.c`` and ``decode.c`` once per machine and load them,
as one library, with ctypes.

The library is built on first use with the system C compiler (``$CC``, else ``cc``) and ``-O3 -march=native``, so
the instruction set (AVX512-VNNI, AVX2 or plain C) is the one of the machine that runs it. The shared object goes to
``$XDG_CACHE_HOME/rooflm`` (else ``~/.cache/rooflm``) under a name keyed by a hash of the source, the compiler's
version and the flags; it is compiled to a temporary name and renamed into place, so processes that build at the
same time each end with a complete file. No torch headers are involved: a build takes about a second.

``ROOFLM_CPU_NATIVE``: ``auto`` (default) uses the kernel when it builds and falls back to torch's kernels (with one
log line) when it does not; ``on`` raises when it cannot be built; ``off`` never builds it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = ("qmm.c", "ops.c", "decode.c")  # the quantized matmul; the small float ops; a decode layer of both
HEADERS = ("qmm_tiles.h",)  # included by qmm.c: its register tiles, one form per instruction set
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")  # + default_flags()
MODES = ("auto", "on", "off")
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}

_libs: dict[tuple[str, ...], ctypes.CDLL] = {}
_failed: dict[tuple[str, ...], str] = {}
_MISSING = object()
_answer: dict[str | None, ctypes.CDLL | None] = {}  # ROOFLM_CPU_NATIVE's raw value -> native_library()'s answer


class NativeBuildError(RuntimeError):
    """The native kernel could not be compiled or loaded."""


def native_mode() -> str:
    """``ROOFLM_CPU_NATIVE``, checked: one of ``auto``, ``on``, ``off``."""
    mode = os.environ.get("ROOFLM_CPU_NATIVE", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"ROOFLM_CPU_NATIVE={mode!r} is not supported: expected one of {MODES}")
    return mode


def compiler() -> str:
    """The C compiler to build with: ``$CC`` or ``cc``."""
    return os.environ.get("CC", "cc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rooflm"


def _source_texts() -> list[bytes]:
    """The sources, then the headers (both in the cache key)."""
    return [resources.files("rooflm.kernels.cpu_native").joinpath(name).read_bytes() for name in SOURCES + HEADERS]


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@functools.lru_cache(maxsize=1)
def torch_openmp_is_libgomp() -> bool:
    """True when the OpenMP runtime loaded in this process (torch's) is GNU libgomp: a library built with
    ``-fopenmp`` then binds to that same runtime (same soname, already loaded) and shares torch's threads."""
    import torch  # noqa: F401  (loads its OpenMP runtime)

    try:
        with open("/proc/self/maps") as f:
            names = {line.rsplit("/", 1)[-1].strip() for line in f if "omp" in line}
    except OSError:
        return False
    return "libgomp.so.1" in names and not any(n.startswith(("libiomp", "libomp")) for n in names)


def default_flags() -> tuple[str, ...]:
    """Extra flags of the library the CPU path uses: ``-fopenmp`` where torch runs on libgomp."""
    return ("-fopenmp",) if torch_openmp_is_libgomp() else ()


def build_library(extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile (or find in the cache) the library for ``FLAGS + extra_flags``; its path. Raises
    ``NativeBuildError`` when there is no compiler or the build fails."""
    cc = compiler()
    if shutil.which(cc) is None:
        raise NativeBuildError(f"no C compiler: {cc!r} is not on PATH (set CC to another one)")
    srcs = _source_texts()
    flags = FLAGS + tuple(extra_flags)
    try:
        version = _compiler_version(cc)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"{cc} --version failed: {e}") from e
    key = hashlib.sha256(b"\0".join([*srcs, version.encode(), " ".join(flags).encode()])).hexdigest()[:20]
    out_dir = cache_dir()
    target = out_dir / f"rooflm_qmm_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        for name, src in zip(SOURCES + HEADERS, srcs, strict=True):
            (Path(tmp) / name).write_bytes(src)
        c_paths = [Path(tmp) / name for name in SOURCES]
        so_tmp = Path(tmp) / target.name
        cmd = [cc, *flags, "-o", str(so_tmp), *map(str, c_paths), "-lm"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            raise NativeBuildError(f"{' '.join(cmd)} failed: {e}") from e
        if res.returncode != 0:
            raise NativeBuildError(f"{' '.join(cmd)} failed:\n{res.stderr.strip()[-2000:]}")
        os.replace(so_tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.qmm_isa.restype = ctypes.c_int
    lib.qmm_isa.argtypes = []
    lib.qmm_set_spin.restype = None
    lib.qmm_set_spin.argtypes = [ctypes.c_int]
    lib.qmm_matmul.restype = ctypes.c_int
    lib.qmm_matmul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.ops_rms_norm.restype = None
    lib.ops_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_int64]
    lib.ops_attend.restype = ctypes.c_int
    lib.ops_attend.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_int]
    lib.ops_argmax.restype = None
    lib.ops_argmax.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ops_rope_write.restype = None
    lib.ops_rope_write.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.decode_segment.restype = ctypes.c_int
    lib.decode_segment.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    spin = os.environ.get("ROOFLM_CPU_NATIVE_SPIN")
    if spin is not None:
        lib.qmm_set_spin(int(spin))
    return lib


def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The loaded library for these extra flags (built on first use); raises ``NativeBuildError``."""
    key = tuple(extra_flags)
    if key in _libs:
        return _libs[key]
    if key in _failed:
        raise NativeBuildError(_failed[key])
    try:
        lib = _bind(ctypes.CDLL(str(build_library(key))))
    except (NativeBuildError, OSError) as e:
        _failed[key] = str(e)
        raise NativeBuildError(str(e)) from e
    _libs[key] = lib
    return lib


def native_library() -> ctypes.CDLL | None:
    """The library the CPU path should use under ``ROOFLM_CPU_NATIVE``: None when off, or (``auto``) when it cannot
    be built -- logged once; ``on`` raises ``NativeBuildError`` instead.

    Every native operator asks, about 150 times per decode step of a 30-layer model: the answer is kept with the
    variable's raw value it was made for, so a call costs one environment lookup while the variable is unchanged."""
    raw = os.environ.get("ROOFLM_CPU_NATIVE")
    known = _answer.get(raw, _MISSING)
    if known is not _MISSING:
        return known
    lib = _native_library()
    _answer.clear()
    _answer[raw] = lib
    return lib


def _native_library() -> ctypes.CDLL | None:
    mode = native_mode()
    if mode == "off":
        return None
    key = tuple(default_flags())
    lib = _libs.get(key)
    if lib is not None:  # the common case, asked by every native operator call: no exception path
        return lib
    if mode == "auto" and key in _failed and getattr(native_library, "_logged", False):
        return None
    try:
        return load_library(default_flags())
    except NativeBuildError as e:
        if mode == "on":
            raise
        if not getattr(native_library, "_logged", False):
            native_library._logged = True  # type: ignore[attr-defined]
            logger.warning("native CPU kernels (quantized matmul, float32 operators) unavailable, using torch's: %s", e)
        return None


def isa_name(lib: ctypes.CDLL) -> str:
    """The instruction set the library was compiled for."""
    return ISA_NAMES[lib.qmm_isa()]


def reset_cache_state() -> None:
    """Forget loaded and failed builds of this process (tests that change the compiler or the cache)."""
    _libs.clear()
    _failed.clear()
    _answer.clear()
    if hasattr(native_library, "_logged"):
        del native_library._logged
