"""Devices: peak OPs/s per dtype, memory bandwidth and size, interconnect bandwidth.

The catalog ``devices/catalog.json`` gives a source (datasheet) for every device. Users add devices from a JSON or
YAML file with the same fields (``load_device_file``); ``Hardware.from_measured`` builds one from measured numbers."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

GB = 1e9  # bandwidths: vendors' GB/s are decimal
GIB = 2**30  # memory sizes: HBM/GDDR capacities are binary
TERA = 1e12
PEAK_KEYS = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4")


@dataclass(frozen=True)
class Hardware:
    """One device. Units: ``memory_bandwidth`` bytes/s, ``memory_bytes`` bytes, ``peak_ops`` OPs/s per dtype key
    (a multiply-accumulate counts 2), ``interconnect_bandwidth`` bytes/s per GPU per direction (None: no link)."""

    name: str
    memory_bandwidth: float
    memory_bytes: float
    peak_ops: dict[str, float]
    interconnect_bandwidth: float | None = None
    kind: str = "gpu"
    source: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.memory_bandwidth, (int, float)) and self.memory_bandwidth > 0):
            raise ValueError(f"hardware {self.name!r}: memory_bandwidth={self.memory_bandwidth!r} is invalid: "
                             "expected a positive number of bytes/s")
        if not (isinstance(self.memory_bytes, (int, float)) and self.memory_bytes > 0):
            raise ValueError(f"hardware {self.name!r}: memory_bytes={self.memory_bytes!r} is invalid: "
                             "expected a positive number of bytes")
        if not self.peak_ops:
            raise ValueError(f"hardware {self.name!r}: peak_ops is empty: expected at least one of {PEAK_KEYS}")
        for k, v in self.peak_ops.items():
            if k not in PEAK_KEYS:
                raise ValueError(f"hardware {self.name!r}: peak dtype {k!r} is invalid: expected one of {PEAK_KEYS}")
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"hardware {self.name!r}: peak_ops[{k!r}]={v!r} is invalid: expected OPs/s > 0")
        bw = self.interconnect_bandwidth
        if bw is not None and not (isinstance(bw, (int, float)) and bw > 0):
            raise ValueError(f"hardware {self.name!r}: interconnect_bandwidth={bw!r} is invalid: expected bytes/s > 0")

    def peak(self, key: str) -> float:
        if key not in self.peak_ops:
            raise ValueError(f"hardware {self.name!r} has no {key} peak: has {sorted(self.peak_ops)}")
        return self.peak_ops[key]

    def ridge_point(self, key: str = "fp16") -> float:
        """Arithmetic intensity (OPs/byte) where the compute and memory roofs meet: peak / bandwidth."""
        return self.peak(key) / self.memory_bandwidth

    @classmethod
    def from_measured(cls, bandwidth_gbs: float, peak_tflops: float | dict[str, float], *,
                      memory_gib: float = 16.0, interconnect_gbs: float | None = None, name: str = "measured",
                      dtype: str = "fp16", source: str = "measured") -> "Hardware":
        """A device from measured numbers: bandwidth in GB/s (1e9), peak in TFLOP/s for ``dtype`` (or a dict of
        dtype -> TFLOP/s). Example: ``Hardware.from_measured(3000, 900)`` for a measured H100."""
        peaks = peak_tflops if isinstance(peak_tflops, dict) else {dtype: peak_tflops}
        return cls(name=name, memory_bandwidth=bandwidth_gbs * GB, memory_bytes=memory_gib * GIB,
                   peak_ops={k: v * TERA for k, v in peaks.items()},
                   interconnect_bandwidth=None if interconnect_gbs is None else interconnect_gbs * GB,
                   kind="measured", source=source, key=name)

    @classmethod
    def from_entry(cls, key: str, e: dict[str, Any]) -> "Hardware":
        """From a catalog / device-file entry (the units of ``devices/catalog.json``)."""
        required = ("memory_bandwidth_gbs", "memory_gib", "peak_tflops")
        missing = [f for f in required if f not in e]
        if missing:
            raise ValueError(f"device {key!r}: missing field(s) {', '.join(missing)}: a device needs {required} "
                             "and may have name, kind, interconnect_gbs, source")
        if not isinstance(e["peak_tflops"], dict):
            raise ValueError(f"device {key!r}: peak_tflops={e['peak_tflops']!r} is invalid: expected a mapping "
                             f"of dtype ({', '.join(PEAK_KEYS)}) to TFLOP/s")
        ic = e.get("interconnect_gbs")
        return cls(name=str(e.get("name", key)), memory_bandwidth=float(e["memory_bandwidth_gbs"]) * GB,
                   memory_bytes=float(e["memory_gib"]) * GIB,
                   peak_ops={k: float(v) * TERA for k, v in e["peak_tflops"].items()},
                   interconnect_bandwidth=None if ic is None else float(ic) * GB,
                   kind=str(e.get("kind", "gpu")), source=str(e.get("source", "")), key=key)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "kind": self.kind,
                "memory_bandwidth_gbs": self.memory_bandwidth / GB, "memory_gib": self.memory_bytes / GIB,
                "interconnect_gbs": None if self.interconnect_bandwidth is None else self.interconnect_bandwidth / GB,
                "peak_tflops": {k: v / TERA for k, v in self.peak_ops.items()}, "source": self.source}


@dataclass
class Catalog:
    devices: dict[str, dict[str, Any]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> Hardware:
        key = name.strip().lower()
        key = self.aliases.get(key, key)
        if key not in self.devices:
            raise ValueError(f"hardware={name!r} is unknown: expected one of {', '.join(sorted(self.devices))} "
                             f"(aliases: {', '.join(sorted(self.aliases))}), or add it with --device-file")
        return Hardware.from_entry(key, self.devices[key])


def builtin_catalog() -> Catalog:
    text = (resources.files("rooflm.roofline") / "devices" / "catalog.json").read_text()
    raw = json.loads(text)
    return Catalog(dict(raw["devices"]), dict(raw.get("aliases", {})))


def load_device_file(path: str) -> dict[str, dict[str, Any]]:
    """Devices from a JSON or YAML file: ``{"devices": {key: entry, ...}}``, ``{key: entry, ...}`` or one entry
    (its key: ``key`` or ``name``). Entries use the catalog's fields and units (see docs/roofline.md)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"device_file={path!r}: no such file")
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        raw = yaml.safe_load(text)
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"device_file={path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"device_file={path!r}: expected a mapping of devices, got {type(raw).__name__}")
    if "devices" in raw:
        raw = raw["devices"]
    elif "memory_bandwidth_gbs" in raw:  # a single entry
        key = str(raw.get("key") or raw.get("name") or os.path.splitext(os.path.basename(path))[0])
        raw = {key: raw}
    out = {str(k).lower(): dict(v) for k, v in raw.items()}
    for k, v in out.items():
        Hardware.from_entry(k, v)  # validate now: errors name the file's device
    return out


def get_hardware(name: str, device_file: str | None = None) -> Hardware:
    """A device by catalog key or alias; ``device_file`` adds (or overrides) devices first."""
    catalog = builtin_catalog()
    if device_file:
        catalog.devices.update(load_device_file(device_file))
    return catalog.resolve(name)


def list_hardware() -> list[str]:
    return sorted(builtin_catalog().devices)
