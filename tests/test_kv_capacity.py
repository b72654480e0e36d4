"""A slice's KV (``StageKV``): what one sequence holds, what a capacity of C positions reserves, and the
largest capacity a room holds, for full-context layers, sliding windows and recurrent state (plain values)."""

from __future__ import annotations

import itertools

import pytest

from stagemesh_core.memory import LayerKV, StageKV, TensorBytes, kv_capacity_tokens

FULL = LayerKV(per_token=8)
WINDOW = LayerKV(per_token=8, window=4)
STATE = LayerKV(state=TensorBytes(packed=100, elements=10))


def test_one_sequence_holds_its_positions_its_windows_and_its_state():
    kv = StageKV.of_layers([FULL, WINDOW, WINDOW, STATE])
    assert kv == StageKV(per_token=8, windows=((16, 4),), state=TensorBytes(100, 10))
    # 10 positions in the full layer, at most 4 in each window layer, the state once (2-byte elements).
    assert kv.sequence_bytes(10, 2) == 10 * 8 * 2 + 4 * 16 * 2 + 100 + 10 * 2
    assert kv.sequence_bytes(3, 2) == 3 * 8 * 2 + 3 * 16 * 2 + 120


def test_a_capacity_reserves_every_sequences_window_and_state():
    kv = StageKV.of_layers([FULL, WINDOW, STATE])
    # 100 positions over up to 5 sequences: at most 5 windows of 4 positions, 5 states.
    assert kv.reserved_bytes(100, 1, 5) == 100 * 8 + 20 * 8 + 5 * 110
    # Fewer positions than the windows could hold: the windows hold them all.
    assert kv.reserved_bytes(7, 1, 5) == 7 * 8 + 7 * 8 + 5 * 110


@pytest.mark.parametrize("layers", [
    [FULL], [FULL, WINDOW], [WINDOW], [WINDOW, LayerKV(per_token=3, window=9)], [FULL, STATE], [STATE],
    [FULL, WINDOW, LayerKV(per_token=5, window=2), STATE], [],
])
def test_capacity_is_the_most_positions_whose_reservation_fits(layers):
    kv = StageKV.of_layers(layers)
    for room, element, sequences in itertools.product(range(0, 700, 13), (1, 2), (1, 3)):
        capacity = kv.capacity(room, element, sequences)
        if capacity is None:  # any number fits: no full-context layer, every window and state fits
            assert kv.per_token == 0 and kv.reserved_bytes(10**9, element, sequences) <= room
            assert kv_capacity_tokens(room, kv, element, sequences, 50) == sequences * 50
            continue
        fits = [c for c in range(200) if kv.reserved_bytes(c, element, sequences) <= room]
        assert capacity == (max(fits) if fits else 0), (room, element, sequences)


def test_full_context_layers_alone_count_as_before():
    kv = StageKV.of_layers([FULL] * 3)
    assert kv.capacity(10_000, 2, 64) == 10_000 // (3 * 8 * 2)
    assert kv.reserved_bytes(50, 2, 64) == kv.sequence_bytes(50, 2) == 50 * 3 * 8 * 2


def test_a_stage_short_of_its_sequences_states_names_max_num_seqs():
    from stage_worker.service.memory import MemoryBudget, MemoryBudgetError, kv_token_capacity

    budget = MemoryBudget(total_bytes=2_000_000_000, available_bytes=2_000_000_000, fraction=0.5, stages_on_host=1)
    kv = StageKV.of_layers([FULL, LayerKV(state=TensorBytes(packed=10_000_000))])
    # 64 sequences' 10 MB states do not fit beside 500 MB of weights; 16 do.
    with pytest.raises(MemoryBudgetError, match="recurrent state of --max-num-seqs 64 sequences.*--max-num-seqs"):
        kv_token_capacity(budget, 500_000_000, kv, 2, 64, 4096, "stage 1")
    assert kv_token_capacity(budget, 500_000_000, kv, 2, 16, 4096, "stage 1") == kv.capacity(
        1_000_000_000 - 500_000_000 - (256 << 20), 2, 16)
