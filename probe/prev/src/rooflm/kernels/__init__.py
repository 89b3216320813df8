"""Triton kernels for the GPU fast path, each with a plain-torch reference twin (``*_ref``) in the same file.

Kernels run on CUDA; on a CPU the same code runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before
``triton`` is imported), which is how ``tests/kernels`` checks them in CI. Importing this package does not import
triton; each kernel module does.

The layers do not consult any global switch here: each op (``rooflm.layers.custom_op.CustomOp``) chooses between its
plain-torch path and these kernels once, when the model is built under ``op_selection(device, ops, attention)``.
``ops="auto"`` takes the kernels on CUDA unless ``ROOFLM_KERNELS=0`` is set in the environment; ``ops="native"`` (or
``select_ops(model, "native")`` on a built model) keeps every layer on the reference path.
"""
