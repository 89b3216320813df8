"""Triton kernels for the GPU fast path, each with a plain-torch reference twin (``*_ref``) in the same file.

Kernels run on CUDA; on a CPU the same code runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before
``triton`` is imported), which is how ``tests/kernels`` checks them in CI. Importing this package does not import
triton; each kernel module does.
"""
