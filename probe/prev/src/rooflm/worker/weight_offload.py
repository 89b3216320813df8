"""Weight offloading: run a model larger than the device by keeping some decoder layers' weights in host memory and
streaming them in, one layer ahead of the compute (FlexGen, Sheng et al. 2023; ZeRO-Inference, Aminabadi et al.
2022).

``cpu_offload_gb`` (vLLM's name) of the decoder layers' weights stay in pinned host memory; the layers chosen are
spread evenly over the depth, so between two offloaded layers the device computes resident ones while the copy runs;
each offloaded layer's tensors live in one page-locked host buffer (``HostLayerBuffer``).
Two device buffers ("slots") of one layer's size take turns (so offloading k layers saves k - 2 layers of device
memory; ``choose_offloaded`` adds the two): before offloaded layer ``i`` runs, the compute stream
waits for its copy; right after, the copy of offloaded layer ``i + 1`` is issued on a side stream into the other slot,
once the layer that used that slot last has finished reading it. The copy of the first offloaded layer of the next
step is issued when a step's last offloaded layer is done, so it overlaps the LM head, sampling and the host's work.

A decode step therefore costs at least ``offloaded bytes / host-to-device bandwidth``; a batch of B sequences shares
that cost, so throughput grows with the batch until the compute of a step exceeds the transfer (the regime FlexGen
targets). The layers' parameters point at the host copies between steps and at a slot while they run; CUDA graphs are
not used (the engine forces eager mode), since the copies are issued from Python hooks.

On a CPU device the same code runs with plain copies (there is no second memory to offload to): that is how the
mechanism is tested without a GPU.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

GiB = 2**30


def _tensors(layer: nn.Module) -> list[tuple[nn.Module, str, bool]]:
    """(owner module, attribute, is_parameter) for every parameter and buffer of ``layer``, each tensor once."""
    out, seen = [], set()
    for module in layer.modules():
        for kind, table in ((True, module._parameters), (False, module._buffers)):
            for name, t in table.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((module, name, kind))
    return out


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a rooflm model (``model.model.layers``)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers to offload")
    return layers


def layer_nbytes(layer: nn.Module) -> int:
    return sum(getattr(m, n).numel() * getattr(m, n).element_size() for m, n, _ in _tensors(layer))


def choose_offloaded(num_layers: int, layer_bytes: int, offload_bytes: int) -> list[int]:
    """Indices of the layers to offload, spread evenly over the depth: enough that the device memory saved covers
    ``offload_bytes`` although the two slots take two layers' worth of it back."""
    if offload_bytes <= 0:
        return []
    count = min(num_layers, math.ceil(offload_bytes / max(layer_bytes, 1)) + 2)
    return sorted({(i * num_layers) // count for i in range(count)})


class WeightOffloader:
    """Streams the weights of ``layers[i]`` for i in ``offloaded`` (already in host memory) into two device slots
    around each forward; see the module docstring."""

    def __init__(self, layers: Sequence[nn.Module], offloaded: Sequence[int], device: torch.device,
                 host_buffers: Sequence["HostLayerBuffer"] = ()) -> None:
        self.device = torch.device(device)
        self.host_buffers = list(host_buffers)  # kept alive (and page-locked) as long as the offloader
        self.layers = [layers[i] for i in offloaded]
        self.indices = list(offloaded)
        if not self.layers:
            raise ValueError("WeightOffloader needs at least one offloaded layer")
        self._entries = [_tensors(layer) for layer in self.layers]
        shapes = [[(getattr(m, n).shape, getattr(m, n).dtype) for m, n, _ in e] for e in self._entries]
        if any(s != shapes[0] for s in shapes):
            raise ValueError("offloaded layers must have the same parameter shapes (one slot layout for all)")
        # the host copies: what each entry holds between steps
        self._host = [[getattr(m, n).data for m, n, _ in e] for e in self._entries]
        self._slots = [[torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in shapes[0]]
                       for _ in range(2)]
        self.bytes_per_layer = sum(t.numel() * t.element_size() for t in self._slots[0])
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._copied = [torch.cuda.Event() if cuda else None for _ in self.layers]  # copy of layer j done
        self._slot_free = [torch.cuda.Event() if cuda else None for _ in range(2)]  # last reader of slot s done
        self._owner = [-1, -1]  # which offloaded layer each slot holds (or is receiving)
        self.copies = 0  # layers copied so far (tests count them)
        for j, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(lambda mod, args, j=j: self._before(j))
            layer.register_forward_hook(lambda mod, args, out, j=j: self._after(j))

    @property
    def offloaded_bytes(self) -> int:
        return self.bytes_per_layer * len(self.layers)

    def _issue(self, j: int) -> None:
        """Make slot j % 2 hold offloaded layer j: a copy on the side stream, after the slot's last reader, unless
        the slot already holds it (the weights never change). Any order of forwards is safe: a layer whose slot was
        taken by another is copied again."""
        s = j % 2
        if self._owner[s] == j:
            return
        self._owner[s] = j
        if self._copy_stream is None:
            for dst, src in zip(self._slots[s], self._host[j]):
                dst.copy_(src)
        else:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._slot_free[s])
                for dst, src in zip(self._slots[s], self._host[j]):
                    dst.copy_(src, non_blocking=True)
                self._copied[j].record(self._copy_stream)
        self.copies += 1

    def _point(self, j: int, tensors: list[torch.Tensor]) -> None:
        for (module, name, _), t in zip(self._entries[j], tensors):
            getattr(module, name).data = t

    def _before(self, j: int) -> None:
        self._issue(j)
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied[j])
        self._point(j, self._slots[j % 2])
        if j + 1 < len(self.layers):  # prefetch the next one into the other slot, freed by layer j - 1
            self._issue(j + 1)

    def _after(self, j: int) -> None:
        if self._copy_stream is not None:
            self._slot_free[j % 2].record(torch.cuda.current_stream(self.device))
        self._point(j, self._host[j])  # between uses the parameters show their host copies
        if j == len(self.layers) - 1:  # the next step's first offloaded layer, overlapping the LM head and sampling
            self._issue(0)


class HostLayerBuffer:
    """One offloaded layer's host memory: a single allocation that the layer's tensors are carved from, page-locked
    with ``cudaHostRegister`` when the device is a GPU (copies from page-locked memory run at the bus's speed and
    asynchronously). Registered rather than allocated with ``pin_memory=True``: torch's pinned allocator rounds each
    allocation up to a power of two, which for a 70B model's layers wastes a quarter of the host memory."""

    ALIGN = 256  # bytes; every tensor starts aligned for vectorised copies

    def __init__(self, tensors: Sequence[torch.Tensor], register: bool) -> None:
        offsets, total = [], 0
        for t in tensors:
            total = -(-total // self.ALIGN) * self.ALIGN
            offsets.append(total)
            total += t.numel() * t.element_size()
        self.base = torch.empty(max(total, 1), dtype=torch.uint8)
        self.nbytes = total
        self.views = [self.base[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                      for o, t in zip(offsets, tensors)]
        self._registered = False
        if register and total:
            err = torch.cuda.cudart().cudaHostRegister(self.base.data_ptr(), total, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {total / 2**30:.2f} GiB of host memory failed (error "
                                   f"{int(err)}): lower cpu_offload_gb or free host memory")
            self._registered = True

    def __del__(self) -> None:
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self.base.data_ptr())
            self._registered = False


def materialize_with_offload(model: nn.Module, layers: Sequence[nn.Module], offloaded: Sequence[int],
                             device: torch.device) -> list[HostLayerBuffer]:
    """Give every tensor of a model built on the meta device its storage: the offloaded layers' in host memory (one
    page-locked buffer per layer on a GPU), the rest on ``device``; then re-make the buffers computed at
    construction (modules with an ``init_buffers`` method, e.g. the rotary embedding's inverse frequencies).
    Contents are uninitialised. Returns the host buffers, which must live as long as the model."""
    device = torch.device(device)
    made: dict[int, torch.Tensor] = {}  # meta tensor id -> its replacement (a tied weight is replaced once)

    def replace(table: dict, name: str, t: torch.Tensor, data: torch.Tensor) -> None:
        new = nn.Parameter(data, requires_grad=False) if isinstance(t, nn.Parameter) else data
        made[id(t)] = new
        table[name] = new

    host: list[HostLayerBuffer] = []
    for i in offloaded:
        slots = [(table, name, t) for m in layers[i].modules() for table in (m._parameters, m._buffers)
                 for name, t in table.items() if t is not None and t.is_meta and id(t) not in made]
        buf = HostLayerBuffer([t for _, _, t in slots], register=device.type == "cuda")
        host.append(buf)
        for (table, name, t), view in zip(slots, buf.views):
            replace(table, name, t, view)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) in made:
                    table[name] = made[id(t)]
                else:
                    replace(table, name, t, torch.empty(t.shape, dtype=t.dtype, device=device))
    for module in model.modules():
        init = getattr(module, "init_buffers", None)
        if callable(init):
            init()
    return host
