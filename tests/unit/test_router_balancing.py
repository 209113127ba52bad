import collections
import random
from dataclasses import dataclass

from llmgw.router.balancing import HashRing, LeastOutstanding, PrefixAffinity, power_of_two, prefix_text


@dataclass(eq=False)
class M:
    id: str
    outstanding: int = 0


def everyone(m):
    return True


def test_power_of_two_never_picks_the_most_loaded_of_many():
    rng = random.Random(1)
    ms = [M("a", 0), M("b", 5), M("c", 5), M("d", 9)]
    picks = collections.Counter(power_of_two(ms, rng).id for _ in range(2000))
    assert picks["d"] == 0  # it loses every pair it is in
    assert picks["a"] > picks["b"] and picks["a"] > picks["c"]


def test_least_outstanding_respects_eligibility():
    s = LeastOutstanding(random.Random(2))
    ms = [M("a"), M("b"), M("c")]
    assert {s.pick(ms, lambda m: m.id == "b", None).id for _ in range(50)} == {"b"}
    assert s.pick(ms, lambda m: False, None) is None
    assert s.pick([M("x")], everyone, None).id == "x"


def test_least_outstanding_spreads_load_evenly():
    s = LeastOutstanding(random.Random(3))
    ms = [M(str(i)) for i in range(4)]
    for _ in range(400):
        s.pick(ms, everyone, None).outstanding += 1
    assert max(m.outstanding for m in ms) - min(m.outstanding for m in ms) <= 4


def test_ring_walk_visits_every_member_once():
    r = HashRing(["a", "b", "c", "d"])
    for h in (0, 2**63, 2**64 - 1, 12345):
        order = list(r.walk(h))
        assert sorted(order) == [0, 1, 2, 3]


def test_ring_is_consistent_when_a_member_leaves():
    ids = [f"e{i}" for i in range(5)]
    full, less = HashRing(ids), HashRing(ids[:4])
    moved = 0
    for k in range(1000):
        h = (k * 0x9E3779B97F4A7C15) % 2**64
        a = ids[next(full.walk(h))]
        b = ids[:4][next(less.walk(h))]
        if a != "e4":
            moved += a != b
    assert moved == 0  # only keys of the removed member move


def chat(system, user):
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_prefix_text_covers_chat_completion_and_token_prompts():
    assert prefix_text(chat("S" * 10, "hello"), 8) == "system\x00S"
    assert prefix_text({"prompt": "abcdef"}, 4) == "abcd"
    assert prefix_text({"prompt": ["first", "second"]}, 100) == "first"
    assert prefix_text({"prompt": [1, 2, 3]}, 100) == "1,2,3"
    assert prefix_text({"input": "embed me"}, 100) == "embed me"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"},
                                                         {"type": "image_url", "image_url": {}}]}]}
    assert prefix_text(parts, 100).startswith("user\x00look")
    assert prefix_text({}, 10) == "" and prefix_text(None, 10) == ""


def test_prefix_affinity_sends_a_shared_prefix_to_one_endpoint():
    s = PrefixAffinity(prefix_tokens=64, load_bound=1.25)
    ms = [M(f"e{i}") for i in range(4)]
    sys_prompt = "You are a helpful assistant. " * 20
    homes = {s.pick(ms, everyone, chat(sys_prompt, f"question {i}")).id for i in range(50)}
    assert len(homes) == 1


def test_prefix_affinity_spreads_distinct_prefixes():
    s = PrefixAffinity(prefix_tokens=16, load_bound=1.25)
    ms = [M(f"e{i}") for i in range(4)]
    homes = collections.Counter(s.pick(ms, everyone, {"prompt": f"tenant-{i} " * 20}).id for i in range(400))
    assert len(homes) == 4


def test_bounded_load_moves_overflow_along_the_ring():
    s = PrefixAffinity(prefix_tokens=16, load_bound=1.25)
    ms = [M(f"e{i}") for i in range(4)]
    body = {"prompt": "one hot prefix " * 10}
    for _ in range(100):
        s.pick(ms, everyone, body).outstanding += 1
    loads = sorted(m.outstanding for m in ms)
    # no endpoint exceeds ceil(1.25 * mean) although every request wants the same one
    assert loads[-1] <= 32
    assert sum(loads) == 100


def test_prefix_affinity_skips_ineligible_home_and_falls_back_without_prompt():
    s = PrefixAffinity(prefix_tokens=16, load_bound=1.25)
    ms = [M(f"e{i}") for i in range(3)]
    body = {"prompt": "x" * 100}
    home = s.pick(ms, everyone, body)
    other = s.pick(ms, lambda m: m is not home, body)
    assert other is not home
    assert s.pick(ms, everyone, {"prompt": ""}) in ms
    assert s.pick(ms, lambda m: False, body) is None
