"""One reading of the Prometheus text format (llmgw/promtext.py) for liveness, engine signals and pair proofs."""

from __future__ import annotations

import math

from llmgw import promtext

PAGE = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0 1733580000000
vllm:num_requests_waiting_total 99
vllm:prompt_tokens_total{model_name="odd} \\"name"} 12
vllm:kv_cache_usage_perc NaN
vllm:generation_tokens_total not-a-number
"""


def test_samples_give_name_labels_and_value_and_skip_what_does_not_parse():
    got = list(promtext.samples(PAGE))
    assert [(n, v) for n, _, v in got if not math.isnan(v)] == [
        ("vllm:num_requests_waiting", 3.0), ("vllm:num_requests_waiting", 4.0),  # the timestamp is not the value
        ("vllm:num_requests_waiting_total", 99.0), ("vllm:prompt_tokens_total", 12.0)]
    assert got[3][1] == '{model_name="odd} \\"name"}'  # a brace and an escaped quote inside a label value
    assert math.isnan(got[4][2]) and len(got) == 5  # NaN is a value; "not-a-number" is not


def test_only_the_names_asked_for_and_never_a_longer_name_that_starts_alike():
    assert [n for n, _, _ in promtext.samples(PAGE, ("vllm:num_requests_waiting",))] == [
        "vllm:num_requests_waiting"] * 2
    assert promtext.totals(PAGE, {"vllm:num_requests_waiting", "vllm:num_requests_waiting_total"}) == {
        "vllm:num_requests_waiting": 7.0, "vllm:num_requests_waiting_total": 99.0}


def test_total_sums_every_label_set_and_is_zero_for_a_name_not_on_the_page():
    assert promtext.total(PAGE, "vllm:num_requests_waiting") == 7.0
    assert promtext.total(PAGE, "vllm:absent") == 0.0
    assert promtext.totals("not prometheus at all {{{") == {}
