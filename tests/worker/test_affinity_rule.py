"""The affinity rule (docs/PROTOCOL.md, "Affinity") and the split of shards among live workers:
pure, no Redis."""

import hashlib
import itertools

from tokenfleet.protocol import Keys, Request
from tokenfleet.protocol.affinity import SHARDS, affinity_key, rendezvous_owners, shard_of
from tokenfleet.transport.shards import assign


def test_the_documented_examples_hash_as_protocol_md_says():
    # the worked examples of PROTOCOL.md, recomputed by hand from the rule's words
    def by_hand(material: bytes) -> int:
        return int.from_bytes(hashlib.sha256(material).digest()[:4], "big") % SHARDS

    assert shard_of({"cache_key": "conversation-42"}) == by_hand(b"k:conversation-42") == 0
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "More?"},
    ]
    assert affinity_key({"messages": chat}) == b"m:system\nBe brief.\nuser\nHi\n"
    assert shard_of({"messages": chat}) == shard_of({"messages": chat[:2]})  # every turn, one shard
    assert affinity_key({"input_ids": list(range(40))}) == b"i:" + ",".join(map(str, range(32))).encode()
    assert affinity_key({"prompt": "x" * 300}) == b"p:" + b"x" * 256
    assert affinity_key({"prompt": "A", "cache_key": "k"}) == b"k:k"  # the key wins


def test_a_request_hashes_the_same_from_its_dataclass_and_from_its_wire_map():
    request = Request(id="r1", input_ids=(5, 6, 7), cache_key="user-9")
    assert shard_of(request.to_wire()) == shard_of({"input_ids": [1], "cache_key": "user-9"})


def test_two_workers_split_the_shards_evenly_and_every_shard_has_one_owner():
    for n in (1, 2, 3, 4, 16, 20):
        workers = [f"host-{i}-{n}" for i in range(n)]
        owners = rendezvous_owners(workers, SHARDS, "128")
        assert sorted(owners) == list(range(SHARDS))
        counts = [list(owners.values()).count(w) for w in workers]
        assert max(counts) <= -(-SHARDS // n)
        if n == 2:
            assert counts == [8, 8]


def test_a_worker_leaving_moves_its_own_shards_and_few_others():
    moved_others = []
    for trial in range(50):
        workers = [f"w{trial}-{i}" for i in range(4)]
        before = rendezvous_owners(workers, SHARDS, "512")
        gone = workers[trial % 4]
        after = rendezvous_owners([w for w in workers if w != gone], SHARDS, "512")
        assert all(after[s] != gone for s in after)
        moved_others.append(sum(before[s] != after[s] for s in before if before[s] != gone))
    # the cap moves a few more than the leaver's 4: on average well under one more shard in four
    assert sum(moved_others) / len(moved_others) < 2.0, moved_others


def test_the_assignment_covers_every_shard_once_across_the_fleet():
    keys = Keys("p")
    beats = [
        {"name": "a", "alive": True, "buckets": [16, 32]},
        {"name": "b", "alive": True, "buckets": [32]},
        {"name": "c", "alive": False, "buckets": [16, 32]},  # dead: owns nothing
    ]
    a = assign(keys, "a", [16, 32], beats)
    b = assign(keys, "b", [32], beats)
    for lane in range(2):
        assert keys.request_stream(16, ("interactive", "batch")[lane]) in a.own[lane]  # unsharded: everyone's
        owned = [s for s in a.own[lane] + b.own[lane] if ":s" in s]
        assert len(owned) == len(set(owned)) == SHARDS * 2  # bucket 16: all a's; 32: split a/b
        assert set(a.own[lane]).isdisjoint(a.others[lane])
    assert a.shards_owned == SHARDS + SHARDS // 2 and b.shards_owned == SHARDS // 2
    assert all(s.endswith((":auto", ":auto:batch")) for s in itertools.islice(reversed(a.own[0]), 1))


def test_a_busy_worker_reads_a_quarter_batch_ahead_and_leaves_the_rest_for_others():
    from tokenfleet.worker.policy import read_budget

    assert read_budget(32, [], 0, 0) == (32, 32)  # idle: a whole batch
    assert read_budget(32, [0] * 32, 0, 0) == (8, 8)  # full: a quarter batch ahead, no more
    assert read_budget(32, [0] * 32, 8, 8) == (0, 0)
    assert read_budget(32, [1] * 32, 0, 0) == (32, 8)  # batch-lane work never blocks the top lane
    assert read_budget(32, [0] * 10, 20, 20) == (10, 10)  # free slots plus a quarter, less what waits
    assert read_budget(32, [], 30, 30) == (2, 2)  # never more than a batch waiting
    assert read_budget(2, [0, 0], 0, 0) == (1, 1)


def test_the_gateway_passes_prompt_cache_key_or_user_as_the_affinity_key():
    from tokenfleet.producer.openai.format import ChatBody, CompletionBody

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatBody(**chat, prompt_cache_key="conv-7").request_params(16)["cache_key"] == "conv-7"
    assert ChatBody(**chat, user="u-1").request_params(16)["cache_key"] == "u-1"
    assert ChatBody(**chat, user="u-1", prompt_cache_key="k").request_params(16)["cache_key"] == "k"
    assert "cache_key" not in CompletionBody(model="m", prompt="hi").request_params(16)
    long = CompletionBody(model="m", prompt="hi", prompt_cache_key="x" * 1000).request_params(16)
    assert long["cache_key"] == hashlib.sha256(b"x" * 1000).hexdigest()  # too long: its digest
    Request(id="r", prompt="hi", cache_key=long["cache_key"])  # fits the protocol
