"""The primer's collectives (kit/lab/collectives.py, kit/lab/collectives_rank.py): one real
torchrun launch of 2 processes over gloo, every case read back."""

from __future__ import annotations

import pytest

from kit.lab import collectives


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return collectives.run(tmp_path_factory.mktemp("primer") / "launch", nproc=2, device="cpu")


def outputs(results, case):
    return [r["output"] for r in results[case]]


def test_each_rank_is_told_who_it_is(results):
    env = collectives.environment(results)
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in env] == [("0", "0", "2"),
                                                                           ("1", "1", "2")]
    assert len({e["pid"] for e in env}) == 2 and len({e["parent pid"] for e in env}) == 1
    assert {e["backend"] for e in env} == {"gloo"}


def test_the_collectives_compute_what_they_promise(results):
    assert outputs(results, "all_gather") == [[1, 2, 11, 12]] * 2
    assert outputs(results, "reduce_scatter") == [[3, 6], [9, 12]]  # [1..4] + 2 * [1..4], split
    assert outputs(results, "all_reduce") == [[3, 6, 9, 12]] * 2
    assert outputs(results, "broadcast") == [[1, 2, 3, 4]] * 2


def test_bytes_written_against_a_ring(results):
    rows = {(r["collective"], r["rank"]): r for r in collectives.bytes_table(results)}
    per_byte = {key: (r["wrote / input"], r["a ring / input"]) for key, r in rows.items()}
    assert per_byte[("all_gather", 0)] == (1.0, 1.0) and per_byte[("all_reduce", 1)] == (1.0, 1.0)
    assert per_byte[("reduce_scatter", 0)] == (1.0, 0.5)  # gloo writes it all, a ring half
    assert per_byte[("broadcast", 0)] == (1.0, 1.0) and per_byte[("broadcast", 1)] == (0.0, 0.0)
    assert rows[("broadcast", 0)]["received"] == rows[("broadcast", 1)]["wrote"]


def test_fsdp_step_by_hand_is_fully_shards(results):
    for r in results["fsdp_step"]:
        assert r["same gradient"] and r["same input gradient"]
    calls = {(c["phase"], c["collective"]): c["calls"] for c in collectives.fsdp_calls(results)
             if c["rank"] == 0}  # fmt: skip
    assert sorted(calls.values()) == [1, 1, 1] and len(calls) == 3
    assert [phase for phase, _ in calls].count("backward") == 2


def test_ring_writes():
    assert collectives.ring_writes("all_gather", 8, 0, 8) == 56
    assert collectives.ring_writes("reduce_scatter", 64, 3, 8) == 56
    assert collectives.ring_writes("all_reduce", 64, 3, 8) == 112
    assert [collectives.ring_writes("broadcast", 10, r, 3) for r in range(3)] == [10, 10, 0]


def test_the_notebook_shows_the_code_the_ranks_ran():
    text = collectives.source("all_gather")
    assert text.startswith("def all_gather(") and "dist.all_gather_into_tensor" in text
    assert "init_process_group" in collectives.source("init", path=collectives.JOIN)
