"""``rooflm bench swap`` and the copy path it times: runs of consecutive host blocks move as single copies, KV comes
back bit for bit in any block order (plain and 8-bit caches), the crossover is the shortest length from which swapping
wins for good, and a broken copy path fails the benchmark."""
from __future__ import annotations

import json

import pytest
import torch

from rooflm.attention.metadata_utils import allocate_kv_caches
from rooflm.bench.swap import crossover, parse_contexts, time_swap_round_trip
from rooflm.cli import main
from rooflm.kv_cache.swap import SwapManager
from rooflm.worker.swap_space import HostSwapSpace, _parts, host_runs


def test_host_runs_split_at_every_gap():
    assert host_runs([]) == []
    assert host_runs([4, 5, 6]) == [(4, 0, 3)]
    assert host_runs([4, 5, 9, 10, 2]) == [(4, 0, 2), (9, 2, 2), (2, 4, 1)]
    assert host_runs([3, 2, 1]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]  # descending ids are not one run


def test_host_pool_hands_out_its_lowest_free_ids():
    sm = SwapManager(8, "swap")
    sm.swap_out("a", [10, 11, 12])
    sm.swap_out("b", [13, 14])
    assert sm.swapped == {"a": [0, 1, 2], "b": [3, 4]}
    sm.swap_in("a", [20, 21, 22])
    sm.take()  # a's host blocks are free again
    sm.swap_out("c", [30, 31, 32, 33])
    assert sm.swapped["c"] == [0, 1, 2, 5]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_scattered_swap_round_trip_restores_every_block(kv_cache_dtype):
    torch.manual_seed(0)
    caches = allocate_kv_caches(3, 10, 4, 2, 8, kv_cache_dtype=kv_cache_dtype)
    for cache in caches:
        for part in _parts(cache):
            part.copy_(torch.randint(-50, 50, part.shape).to(part.dtype))
    snapshot = [[p.clone() for p in _parts(c)] for c in caches]
    space = HostSwapSpace(12, 4, 2, 8, 3, torch.float32, kv_cache_dtype, torch.device("cpu"))
    device_ids, host_ids = [7, 2, 5, 9], [3, 4, 11, 0]  # two runs and two single blocks
    space.run(caches, list(zip(device_ids, host_ids)), [])
    targets = [0, 1, 3, 4]  # blocks that had other contents
    space.run(caches, [], list(zip(host_ids, targets)))
    for cache, before in zip(caches, snapshot):
        for part, old in zip(_parts(cache), before):
            assert torch.equal(part[:, targets], old[:, device_ids])
            untouched = [b for b in range(10) if b not in targets]
            assert torch.equal(part[:, untouched], old[:, untouched])
    assert (space.num_blocks_out, space.num_blocks_in) == (4, 4)


def test_auto_copy_mode_uses_dma_only_for_long_runs():
    caches = allocate_kv_caches(2, 64, 16, 8, 128, dtype=torch.float16)  # 32 KiB per block half
    space = HostSwapSpace(64, 16, 8, 128, 2, torch.float16, "auto", torch.device("cpu"))
    space.mode = "auto"
    long_run = [(d, 10 + d) for d in range(32)]  # one run of 32 blocks: 1 MiB per transfer
    single = [(d, 2 * d) for d in range(32)]  # 32 runs of one block
    assert not space._use_uva(caches, long_run, [])
    assert space._use_uva(caches, single, [])
    assert space._use_uva(caches, [], [(h, d) for d, h in long_run[:16]])  # 512 KiB: issuing costs more
    space.mode = "dma-runs"
    assert not space._use_uva(caches, single, [])


def test_crossover_is_where_swapping_wins_for_good():
    c = [256, 512, 1024, 2048]
    assert crossover(c, [False, False, True, True]) == 1024
    assert crossover(c, [True, False, True, True]) == 1024  # a win below a loss does not count
    assert crossover(c, [True, True, True, True]) == 256
    assert crossover(c, [True, True, True, False]) is None


def test_parse_contexts():
    assert parse_contexts("512, 64,64", 4096, False) == [64, 512]
    assert parse_contexts(None, 4096, True) == [128, 256, 512, 1024, 2048, 4095]
    assert parse_contexts(None, 2048, True) == [128, 256, 512, 1024, 2047]
    assert parse_contexts(None, 8192, False) == [16, 64, 256]
    for bad in ("a,b", "0,16", "", "16,4096"):
        with pytest.raises(ValueError, match="--contexts"):
            parse_contexts(bad, 4096, False)


class _DropsSwapIn(HostSwapSpace):
    def run(self, kv_caches, swap_out, swap_in):
        super().run(kv_caches, swap_out, [])


def test_a_broken_copy_path_fails_the_round_trip_check():
    caches = allocate_kv_caches(2, 6, 4, 2, 8)
    args = (6, 4, 2, 8, 2, torch.float32, "auto", torch.device("cpu"))
    out_s, in_s = time_swap_round_trip(HostSwapSpace(*args), caches, 5, torch.device("cpu"), verify=True)
    assert out_s >= 0 and in_s >= 0
    with pytest.raises(RuntimeError, match="changed the KV"):
        time_swap_round_trip(_DropsSwapIn(*args), caches, 5, torch.device("cpu"), verify=True)


def test_bench_swap_reports_each_context(tmp_path, capsys):
    path = tmp_path / "swap.json"
    assert main(["bench", "swap", "--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "float32", "--contexts", "16,48", "--num-iters", "1", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert [r["context"] for r in res["rows"]] == [16, 48]
    assert [r["blocks"] for r in res["rows"]] == [1, 3]
    per_block = res["kv_bytes_per_block"]
    assert per_block == 30 * 2 * 16 * 3 * 64 * 4  # smollm2-135m: 30 layers, 3 KV heads of 64, float32
    for r in res["rows"]:
        assert r["kv_mib"] == pytest.approx(r["blocks"] * per_block / 2**20)
        assert r["swap_faster"] == (r["swap_ms"] < r["recompute_ms"])
        assert r["predicted_recompute_ms"] > 0 and r["predicted_swap_ms"] > 0
    assert res["measured_crossover_tokens"] == crossover([16, 48], [r["swap_faster"] for r in res["rows"]])
    assert "measured crossover" in capsys.readouterr().out
