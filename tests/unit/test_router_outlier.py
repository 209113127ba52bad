from llmgw.router.outlier import Health, OutlierPolicy
from llmgw.router.settings import Outlier

P = OutlierPolicy(Outlier(consecutive_errors=3, base_ejection=10, max_ejection=25, max_ejection_share=0.5))


def fail(h, now, ejected=0, size=4, n=1):
    out = []
    for _ in range(n):
        out.append(P.on_failure(h, now, ejected, size))
    return out


def test_ejects_after_consecutive_failures_only():
    h = Health()
    assert fail(h, 0, n=2) == [False, False]
    P.on_success(h, 0)
    assert fail(h, 0, n=2) == [False, False]  # the success reset the count
    assert fail(h, 1) == [True]
    assert h.is_ejected(1) and h.is_ejected(10.9) and not h.is_ejected(11)


def test_readmitted_endpoint_is_on_probation_and_backoff_grows_to_the_cap():
    h = Health()
    fail(h, 0, n=3)
    assert h.ejected_until == 10
    assert fail(h, 10) == [True]  # one failure after re-admission is enough
    assert h.ejected_until == 30  # 2 x base
    assert fail(h, 30) == [True]
    assert h.ejected_until == 55  # capped at max_ejection (25)


def test_multiplier_resets_after_serving_as_long_as_the_last_ejection():
    h = Health()
    fail(h, 0, n=3)  # out 0..10
    P.on_success(h, 11)
    assert not h.probation and h.ejections == 1
    P.on_success(h, 20.5)  # back for 10.5s >= 10s ejection
    assert h.ejections == 0
    fail(h, 21, n=3)
    assert h.ejected_until == 31  # base again


def test_failures_while_ejected_are_late_news():
    h = Health()
    fail(h, 0, n=3)
    assert fail(h, 5, n=5) == [False] * 5
    assert h.ejected_until == 10


def test_ejection_share_cap():
    assert P.ejection_cap(1) == 1  # the only endpoint may go: the router then answers 503 fast
    assert P.ejection_cap(4) == 2
    assert P.ejection_cap(3) == 1
    h = Health()
    assert fail(h, 0, ejected=2, size=4, n=3) == [False, False, False]
    assert not h.is_ejected(0)
    assert fail(h, 0, ejected=1, size=4) == [True]
