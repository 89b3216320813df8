"""A native CPU matmul for 4- and 8-bit grouped weights with 8-bit activations (llama.cpp's scheme), and the small
float32 operators of a decode step (RMSNorm, rotary + cache write, attention over the paged cache), and a decoder
layer of a one-token step made of both in one call: the C sources ``qmm.c``, ``ops.c`` and ``decode.c`` are compiled
on first use (``build``) and called through ctypes (``matmul``, ``ops``; ``decode.c`` from
``rooflm.models.cpu_lean_stack``).
``ROOFLM_CPU_NATIVE`` = ``auto`` | ``on`` | ``off`` selects them; ``python -m rooflm.kernels.cpu_native`` benchmarks
the matmul against torch's kernels."""
from rooflm.kernels.cpu_native.build import (
                                              NativeBuildError,
                                              build_library,
                                              default_flags,
                                              isa_name,
                                              load_library,
                                              native_library,
                                              native_mode,
)
from rooflm.kernels.cpu_native.matmul import (
                                              NativeWeight,
                                              native_linear,
                                              native_supports,
                                              pack_native,
                                              quantize_activations_reference,
)

__all__ = ["NativeBuildError", "NativeWeight", "build_library", "default_flags", "isa_name", "load_library",
           "native_library", "native_linear", "native_mode", "native_supports", "pack_native",
           "quantize_activations_reference"]
