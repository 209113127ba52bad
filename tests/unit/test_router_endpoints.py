import asyncio
import threading

import pytest

from llmgw.router.endpoints import Endpoint, EndpointError, EndpointTable, EndpointURLError


def ep(i, model="m", **kw):
    return Endpoint(id=f"e{i}", model=model, url=f"http://127.0.0.1:{9000 + i}", **kw)


def test_endpoint_rejects_bad_fields_naming_them():
    with pytest.raises(EndpointError, match="url"):
        Endpoint(id="a", model="m", url="127.0.0.1:8000")
    with pytest.raises(EndpointError, match="model"):
        Endpoint(id="a", model="", url="http://h:1")
    with pytest.raises(EndpointError, match="max_concurrency"):
        Endpoint(id="a", model="m", url="http://h:1", max_concurrency=0)
    with pytest.raises(EndpointError, match="query"):
        Endpoint(id="a", model="m", url="http://h:1/?x=1")


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://h:-1", "http://h:port", "http://h:0"])
def test_endpoint_with_an_unusable_port_is_rejected(url):
    # urlsplit accepts these; its .port (what the connection pool uses) raises or is useless
    with pytest.raises(EndpointURLError, match="url"):
        Endpoint(id="a", model="m", url=url)
    with pytest.raises(EndpointURLError, match="/static_endpoints/3"):
        Endpoint.from_dict({"model": "m", "url": url}, where="/static_endpoints/3")


def test_from_dict_defaults_id_and_round_trips():
    e = Endpoint.from_dict({"model": "m", "url": "http://h:1/base/"})
    assert e.id == "m@http://h:1/base/"
    assert e.base_url == "http://h:1/base"
    assert Endpoint.from_dict(e.to_dict()) == e
    with pytest.raises(EndpointError, match=r"/endpoints/3/draining"):
        Endpoint.from_dict({"model": "m", "url": "http://h:1", "draining": "yes"}, where="/endpoints/3")
    with pytest.raises(EndpointError, match="unknown key"):
        Endpoint.from_dict({"model": "m", "url": "http://h:1", "weight": 2})


def test_replace_is_atomic_and_bumps_revision():
    t = EndpointTable([ep(1), ep(2, model="n")])
    assert t.revision == 0
    assert t.models() == ["m", "n"]
    assert [e.id for e in t.for_model("m")] == ["e1"]
    assert t.for_model("absent") == ()
    rev = t.replace([ep(3), ep(4)])
    assert rev == t.revision == 1
    assert t.models() == ["m"]
    assert [e.id for e in t.snapshot()[1]] == ["e3", "e4"]


def test_duplicate_ids_change_nothing():
    t = EndpointTable([ep(1)])
    with pytest.raises(EndpointError, match="duplicate"):
        t.replace([ep(2), ep(2)])
    assert t.revision == 0
    assert [e.id for e in t.snapshot()[1]] == ["e1"]


def test_wait_changed_returns_at_once_when_already_newer():
    t = EndpointTable([ep(1)])
    t.replace([ep(2)])

    async def main():
        return await t.wait_changed(0, timeout=30)

    rev, eps = asyncio.run(main())
    assert rev == 1 and [e.id for e in eps] == ["e2"]


def test_wait_changed_is_woken_by_replace_from_another_thread():
    t = EndpointTable()
    started = threading.Event()

    def writer():
        started.wait(10)
        t.replace([ep(7)])

    th = threading.Thread(target=writer)
    th.start()

    async def main():
        task = asyncio.create_task(t.wait_changed(0, timeout=60))
        await asyncio.sleep(0)
        started.set()
        return await task

    rev, eps = asyncio.run(main())
    th.join()
    assert rev == 1 and eps[0].id == "e7"


def test_wait_changed_times_out_with_current_snapshot():
    t = EndpointTable([ep(1)])

    async def main():
        return await t.wait_changed(0, timeout=0.05)

    rev, eps = asyncio.run(main())
    assert rev == 0 and eps[0].id == "e1"
    assert t._waiters == []  # no leak of waiters after timeout


def test_waiters_on_two_loops_are_each_woken():
    t = EndpointTable()
    results = []
    ready = threading.Barrier(3)

    def waiter():
        async def main():
            task = asyncio.create_task(t.wait_changed(0, timeout=60))
            await asyncio.sleep(0)
            await asyncio.get_running_loop().run_in_executor(None, ready.wait)
            return await task
        results.append(asyncio.run(main())[0])

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for th in threads:
        th.start()
    ready.wait(10)
    t.replace([ep(1)])
    for th in threads:
        th.join(10)
    assert results == [1, 1]
