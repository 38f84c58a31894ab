"""Folding one page's samples per instance over data-parallel ranks (backends/metric_samples.py)."""

from __future__ import annotations

from backends.metric_samples import Sample, int_label, label_total, mean, per_rank, total


def test_copies_of_a_rank_collapse_with_max_and_ranks_and_parts_add_up() -> None:
    samples = [
        Sample(3.0, {"engine": "0", "tp_rank": "0"}),
        Sample(5.0, {"engine": "0", "tp_rank": "1"}),  # the same scheduler: max, not 8
        Sample(2.0, {"engine": "1"}),
    ]
    assert per_rank(samples) == {"0": 5.0, "1": 2.0}
    by_name = {"n": samples}
    assert total(by_name, ("missing", "n")) == 7 and total(by_name, ("missing",)) is None
    parts = [Sample(4.0, {"cache_source": "device"}), Sample(6.0, {"cache_source": "host"})]
    assert per_rank(parts, "cache_source") == {"": 10.0}  # distinct parts of one total


def test_utilisations_average_over_ranks_clamped_to_one() -> None:
    usage = {"u": [Sample(0.5, {"dp_rank": "0"}), Sample(0.7, {"dp_rank": "1"})]}
    assert mean(usage, ("u",)) == 0.6
    usage["u"].append(Sample(2.6, {"dp_rank": "2"}))  # an over-committed rank: (0.5+0.7+2.6)/3
    assert mean(usage, ("u",)) == 1.0


def test_integer_labels_of_info_gauges() -> None:
    assert int_label({"block_size": "16.0"}, "block_size") == 16
    assert int_label({"block_size": "None"}, "block_size") is None
    assert int_label({"max_lora": "0"}, "max_lora") is None  # 0: unset
    info = [Sample(1.0, {"engine": "0", "num_gpu_blocks": "100"})]
    info.append(Sample(1.0, {"engine": "1", "num_gpu_blocks": "120"}))
    assert label_total(info, "num_gpu_blocks") == 220
