"""Layers that choose their implementation once, when they are built (the pattern of vLLM's ``CustomOp``).

Every op with a GPU fast path (``Linear``, ``LMHead``, ``RMSNorm``, ``SiluAndMul``, the Mixtral MoE block and the
``Attention`` layer, whose backend does the rotary embedding and the KV-cache write) subclasses ``CustomOp`` and
defines two methods with the same signature:

- ``forward_native``: plain torch, the reference twin; runs on any device;
- ``forward_cuda``: the Triton kernels (``rooflm.kernels``);
- ``forward_cpu`` (optional): the same maths in fewer, larger torch ops (or torch's packed integer matmuls) for a
  model on the CPU, where each small op's dispatch costs about as much as a small layer's arithmetic; an op without
  one runs ``forward_native`` there.

Which one ``forward`` runs is decided in ``CustomOp.__init__`` from the active ``OpSelection``, never in ``forward``.
The loader builds the model inside ``op_selection(device, ops, attention)``; a module built outside any
``op_selection`` runs the reference path. ``select_ops(model, ops)`` re-chooses for a built model (tests comparing
the two paths on the same weights, benchmarks, or a model moved to another device).

``ops`` values:
- ``"auto"``: the Triton path when the model lives on a CUDA device, triton is installed and the environment does not
  set ``ROOFLM_KERNELS=0``; the CPU path for a model on the CPU (unless ``ROOFLM_KERNELS=0``); the reference
  otherwise;
- ``"native"``: the reference path everywhere;
- ``"triton"``: the Triton path (on a CPU only under ``TRITON_INTERPRET=1``, set before triton is imported);
- ``"cpu"``: the CPU path (on any device: it is plain torch).

``attention`` names the attention backend: ``"torch"`` (the reference), ``"triton"``, ``"cpu"``, or ``"auto"``,
which follows the choice made for ``ops`` (``"native"`` -> torch, ``"triton"`` -> triton, ``"cpu"`` -> cpu).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

OPS_CHOICES = ("auto", "native", "triton", "cpu")
ATTENTION_CHOICES = ("auto", "torch", "triton", "cpu")

NATIVE = "native"
TRITON = "triton"
CPU = "cpu"


def triton_available() -> bool:
    """True when the triton package can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def kernels_allowed_by_env() -> bool:
    """``ROOFLM_KERNELS=0`` keeps "auto" on the reference path (read when a selection is resolved)."""
    return os.environ.get("ROOFLM_KERNELS", "1") != "0"


@dataclass(frozen=True)
class OpSelection:
    """The setting every ``CustomOp`` built under it reads: the device the model will live on, the ops setting and
    the attention backend setting (see the module docstring for the values)."""

    device: torch.device
    ops: str = "auto"
    attention: str = "auto"
    # Objects the ops built under one selection share (one model: its layers' attention backend, whose per-step
    # tables are then made once per step instead of once per layer). Not part of equality: a new selection, a new
    # dict, so two models never share state.
    shared: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.ops not in OPS_CHOICES:
            raise ValueError(f"ops={self.ops!r} is invalid: expected one of {OPS_CHOICES}")
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention={self.attention!r} is invalid: expected one of {ATTENTION_CHOICES}")
        object.__setattr__(self, "device", torch.device(self.device))

    def impl(self) -> str:
        """"native", "triton" or "cpu": the implementation of the non-attention ops."""
        if self.ops == "auto":
            if not kernels_allowed_by_env():
                return NATIVE
            if self.device.type == "cuda" and triton_available():
                return TRITON
            return CPU if self.device.type == "cpu" else NATIVE
        if self.ops == TRITON and not triton_available():
            raise ValueError("ops='triton' needs the triton package, which is not installed")
        return self.ops

    def attention_impl(self) -> str:
        """"torch", "triton" or "cpu": the attention backend's name."""
        if self.attention == "auto":
            return {TRITON: "triton", CPU: "cpu"}.get(self.impl(), "torch")
        if self.attention == "triton" and not triton_available():
            raise ValueError("attention='triton' needs the triton package, which is not installed")
        return self.attention


_DEFAULT = OpSelection(torch.device("cpu"), ops=NATIVE)
_active: list[OpSelection] = []
_impl_generation = 0  # bumped whenever an op (re)chooses its implementation or a quantized weight is set


def impl_generation() -> int:
    """A number that changes whenever any ``CustomOp`` re-chooses what it runs: whoever caches facts derived from
    the chosen implementations (``rooflm.models.cpu_lean``) compares it instead of re-checking every op."""
    return _impl_generation


def current_op_selection() -> OpSelection:
    """The innermost active ``op_selection``; outside any, the reference path (ops="native") on the CPU."""
    return _active[-1] if _active else _DEFAULT


@contextlib.contextmanager
def op_selection(device: torch.device | str, ops: str = "auto", attention: str = "auto") -> Iterator[OpSelection]:
    """Every ``CustomOp`` constructed inside the block chooses its implementation for ``device`` from ``ops`` and
    ``attention``. ValueError naming the field for an unknown value. Nests; not thread-safe (build models from one
    thread at a time)."""
    selection = OpSelection(torch.device(device), ops, attention)
    _active.append(selection)
    try:
        yield selection
    finally:
        _active.pop()


class CustomOp(nn.Module):
    """Base of every op with a reference and a Triton implementation. Subclasses call ``super().__init__()`` first
    and define ``forward_native`` and ``forward_cuda``; ``forward`` runs the one chosen at construction.

    The choice is kept as the plain function (not a bound method), so a module holds no reference cycle to itself
    and a deleted model's GPU memory is released at once."""

    impl: str  # "native", "triton" or "cpu": what ``forward`` runs

    def __init__(self) -> None:
        super().__init__()
        self.choose(current_op_selection())

    def choose(self, selection: OpSelection) -> None:
        """Pick the implementation for ``selection``. Called once by ``__init__``; again only by ``select_ops``."""
        self._set_impl(selection.impl())

    def _set_impl(self, impl: str) -> None:
        global _impl_generation
        _impl_generation += 1
        self.impl = impl
        cls = type(self)
        if impl == TRITON:
            fn = cls.forward_cuda
        elif impl == CPU and cls.forward_cpu is not CustomOp.forward_cpu:
            fn = cls.forward_cpu
        else:
            fn = cls.forward_native
        self._impl_fn: Callable[..., Any] = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl_fn(self, *args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        """Overridden by ops with a CPU path; otherwise never called (``forward_native`` is chosen instead)."""
        return self.forward_native(*args, **kwargs)


def _model_device(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def select_ops(
    model: nn.Module, ops: str = "auto", device: torch.device | str | None = None, attention: str = "auto"
) -> dict[str, str]:
    """Re-choose the implementation of every ``CustomOp`` in ``model`` (itself included), as if it had been built
    under ``op_selection(device, ops, attention)``. ``device`` defaults to where the model's first parameter lives.
    Returns {module name: chosen implementation} ("native", "triton" or "cpu"; an attention layer's backend is
    "torch" for "native").

    The explicit way to switch a built model between the reference and the fast path, e.g. to compare both on the
    same weights; the engine never calls it while serving (a CUDA graph keeps the kernels it captured)."""
    selection = OpSelection(torch.device(device) if device is not None else _model_device(model), ops, attention)
    chosen: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, CustomOp):
            module.choose(selection)
            chosen[name] = module.impl
    return chosen


def chosen_ops(model: nn.Module) -> dict[str, str]:
    """{module name: implementation} of every ``CustomOp`` in ``model``, as ``select_ops`` reports it."""
    return {name: m.impl for name, m in model.named_modules() if isinstance(m, CustomOp)}
