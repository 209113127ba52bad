from llmgw.router.budget import RetryBudget


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_minimum_allows_retries_on_a_quiet_router():
    c = Clock()
    b = RetryBudget(0.2, 3, 10, clock=c)
    b.note_request()
    assert [b.try_acquire() for _ in range(4)] == [True, True, True, False]


def test_retries_never_exceed_ratio_of_requests_in_window():
    c = Clock()
    b = RetryBudget(0.2, 3, 10, clock=c)
    granted = 0
    for i in range(100):
        b.note_request()
        c.t += 0.01
        if b.try_acquire():
            granted += 1
    assert granted == 20  # 20% of 100, the minimum being smaller


def test_window_slides():
    c = Clock()
    b = RetryBudget(0.2, 0, 10, clock=c)
    for _ in range(50):
        b.note_request()
    assert sum(b.try_acquire() for _ in range(20)) == 10
    c.t += 5
    assert not b.try_acquire()
    c.t += 6  # the first burst left the window
    assert b.total_requests == 0 and b.total_retries == 0
    for _ in range(10):
        b.note_request()
    assert sum(b.try_acquire() for _ in range(5)) == 2


def test_long_idle_clears_everything():
    c = Clock()
    b = RetryBudget(0.5, 0, 10, clock=c)
    for _ in range(10):
        b.note_request()
    c.t += 3600
    assert b.allowed() == 0
