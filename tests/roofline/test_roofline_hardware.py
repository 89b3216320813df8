"""The device catalog (a cited source per device), user device files (JSON / YAML) and measured devices."""
from __future__ import annotations

import json

import pytest

from rooflm.roofline import Hardware, analyze, get_hardware, list_hardware
from rooflm.roofline.hardware import builtin_catalog, load_device_file

REQUIRED = ("v100", "a6000", "a100-40gb", "a100-80gb", "l40s", "rtx4090", "h100-sxm", "h100-pcie", "h200-sxm", "b200",
            "mi300x")


def test_catalog_has_the_required_devices_each_with_a_source():
    names = list_hardware()
    for key in REQUIRED:
        assert key in names
    cat = builtin_catalog()
    assert sum(1 for e in cat.devices.values() if e["kind"] == "cpu") >= 3
    for key in names:
        hw = get_hardware(key)
        assert "http" in hw.source, key  # a datasheet / product page URL
        assert hw.memory_bandwidth > 0 and hw.memory_bytes > 0
        assert {"fp16", "bf16", "fp32"} & set(hw.peak_ops), key
        if cat.devices[key]["kind"] == "gpu":
            assert hw.interconnect_bandwidth, key


def test_catalog_numbers_from_datasheets():
    # A100 80 GB SXM datasheet: 2,039 GB/s, 312 TFLOP/s dense fp16; H100 SXM: 3.35 TB/s, 989.4 dense fp16
    a100 = get_hardware("a100")  # alias of a100-80gb
    assert (a100.memory_bandwidth, a100.peak("fp16"), a100.memory_bytes) == (2039e9, 312e12, 80 * 2**30)
    h100 = get_hardware("H100")
    assert (h100.key, h100.memory_bandwidth, h100.peak("fp16"), h100.peak("fp8")) == (
        "h100-sxm", 3350e9, 989.4e12, 1978.9e12)
    assert h100.interconnect_bandwidth == 450e9  # NVLink 900 GB/s bidirectional -> 450 per direction
    # ridge point of the A6000: 154.8e12 / 768e9 = 201.5625 OPs/byte
    assert get_hardware("a6000").ridge_point() == pytest.approx(201.5625)


def test_device_file_json(tmp_path):
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"devices": {"My-NPU": {
        "name": "My NPU", "memory_bandwidth_gbs": 500, "memory_gib": 32, "interconnect_gbs": 100,
        "peak_tflops": {"fp16": 100, "int8": 200}, "source": "vendor sheet"}}}))
    hw = get_hardware("my-npu", str(path))
    assert (hw.name, hw.memory_bandwidth, hw.peak("int8")) == ("My NPU", 500e9, 200e12)
    # llama-2-7b decode on it: memory-bound, at least 13.2 GB of weights / 500 GB/s
    r = analyze("llama-2-7b", hw, batch=1, input_len=128, output_len=1)
    assert r.decode.time_s == pytest.approx(r.decode.totals.memory_access / 500e9, rel=1e-9)
    assert "a6000" in [k for k in list_hardware()]  # the built-in catalog is unchanged


def test_device_file_yaml_single_entry(tmp_path):
    path = tmp_path / "board.yaml"
    path.write_text("key: board\nmemory_bandwidth_gbs: 120\nmemory_gib: 16\npeak_tflops:\n  fp16: 20\n")
    assert load_device_file(str(path)) == {"board": {"key": "board", "memory_bandwidth_gbs": 120, "memory_gib": 16,
                                                     "peak_tflops": {"fp16": 20}}}
    assert get_hardware("board", str(path)).memory_bandwidth == 120e9


@pytest.mark.parametrize("entry,msg", [
    ({"memory_gib": 16, "peak_tflops": {"fp16": 1}}, r"missing field\(s\) memory_bandwidth_gbs"),
    ({"memory_bandwidth_gbs": 1, "memory_gib": 16, "peak_tflops": {"fp17": 1}}, r"peak dtype 'fp17' is invalid"),
    ({"memory_bandwidth_gbs": -5, "memory_gib": 16, "peak_tflops": {"fp16": 1}}, r"memory_bandwidth=.* is invalid"),
])
def test_bad_device_file_entries(tmp_path, entry, msg):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"devices": {"x": entry}}))
    with pytest.raises(ValueError, match=msg):
        load_device_file(str(path))


def test_from_measured():
    hw = Hardware.from_measured(bandwidth_gbs=3000, peak_tflops=900, memory_gib=80)
    assert (hw.memory_bandwidth, hw.peak("fp16"), hw.ridge_point()) == (3e12, 9e14, 300)
    # a decode step of llama-2-7b at context 16 is memory-bound: time = bytes / 3e12
    r = analyze("llama-2-7b", hw, batch=1, input_len=16, output_len=1)
    assert r.decode_step_time_s == pytest.approx(r.decode.totals.memory_access / 3e12, rel=1e-9)
