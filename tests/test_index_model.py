"""Model-based test of the prefix index: a random sequence of operations (stores, removals,
clears and replicas coming and going, directly and as sequenced event batches; speculation,
its withdrawal, expiry and cap; awaited stores; compaction, at once and in steps) runs on a
``PrefixIndex`` and on a plain reference model (per replica: a set of blocks per tier, a set
of checkpoints, the speculate calls still alive), and after every operation the index's
answers must equal the reference's, every ``match`` option included.

The reference states the rules directly:

* a replica's speculated blocks of a kind are those named by a call of its that is alive
  (not expired, dropped by the cap or withdrawn), on its current cache, and made after the
  replica's engine last reported that block (stored or removed, any tier);
* a match's KV length is the longest prefix held on some tier or speculated; its GPU /
  host lengths the longest on GPU (or speculated) / GPU or CPU (or speculated), within it;
* its usable length follows ``PrefixIndex.match`` and router/core/engine_hits.py: capped at
  ``eagle_limit``, on the ``align_blocks`` grid, ``peek_blocks`` shorter; a hybrid model's
  ends on a checkpoint.

The index's bisection assumes prefix-closed caches (documented: a hole gives an upper bound),
so operations that would leave a hole in the reference are not issued.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from router.core.engine_hits import eagle_limit, floor_to
from router.core.index import PrefixIndex
from router.core.types import (
    AllCleared,
    ApplyOutcome,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    IndexEvent,
    Kind,
    PrefixMatch,
    ReplicaKey,
    Tier,
)


@dataclass
class Rep:
    epoch: int
    tiers: dict[Tier, set[int]] = field(default_factory=lambda: {t: set() for t in Tier})
    state: set[int] = field(default_factory=set)
    # (kind, block) -> tick of the engine's last word on it (stored or removed)
    settled: dict[tuple[Kind, int], int] = field(default_factory=dict)
    evicted: int = 0
    awaited: set[tuple[Kind, int]] = field(default_factory=set)


@dataclass
class Call:
    spec_id: int
    key: ReplicaKey
    epoch: int
    tick: int
    hashes: dict[Kind, tuple[int, ...]]
    withdrawn: bool = False


class Ref:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.reps: dict[ReplicaKey, Rep] = {}
        self.last_seq: dict[ReplicaKey, int] = {}
        self.ticks = itertools.count()
        self.epochs = itertools.count(1)
        # queued speculate entries: (expiry, spec_id, kind) -> call, as the index queues them
        self.queue: dict[tuple[float, int, int], Call] = {}
        self.state_keys: set[ReplicaKey] = set()

    def rep(self, key: ReplicaKey) -> Rep:
        if key not in self.reps:
            self.reps[key] = Rep(next(self.epochs))
        return self.reps[key]

    def clear(self, key: ReplicaKey) -> None:
        if key in self.reps:
            self.reps[key] = Rep(next(self.epochs))

    def remove_replica(self, key: ReplicaKey) -> None:
        self.reps.pop(key, None)
        self.last_seq.pop(key, None)
        self.state_keys.discard(key)

    def event(self, rep: Rep, key: ReplicaKey, ev: BlocksStored | BlocksRemoved) -> None:
        tick = next(self.ticks)
        table = rep.state if ev.kind is Kind.STATE else rep.tiers[ev.tier]
        for h in ev.hashes:
            rep.settled[(ev.kind, h)] = tick
            if isinstance(ev, BlocksStored):
                table.add(h)
                rep.awaited.discard((ev.kind, h))
            elif h in table:
                table.discard(h)
                if ev.kind is Kind.KV and ev.tier is Tier.GPU:
                    rep.evicted += 1
        if isinstance(ev, BlocksStored) and ev.kind is Kind.STATE and ev.hashes:
            self.state_keys.add(key)

    def apply(self, batch: EventBatch) -> ApplyOutcome:
        outcome = ApplyOutcome.APPLIED
        if batch.seq is not None:
            last = self.last_seq.get(batch.replica)
            if last is not None and batch.seq <= last:
                return ApplyOutcome.DUPLICATE
            if last is not None and batch.seq > last + 1:
                outcome = ApplyOutcome.GAP
            self.last_seq[batch.replica] = batch.seq
        self.rep(batch.replica)
        for ev in batch.events:
            if isinstance(ev, AllCleared):
                self.clear(batch.replica)
            else:
                self.event(self.reps[batch.replica], batch.replica, ev)
        return outcome

    # -------------------------------------------------------------- speculation

    def speculate(self, call: Call, expiry: float) -> None:
        for kind, hashes in call.hashes.items():
            if hashes:
                self.queue[(expiry, call.spec_id, int(kind))] = call
        while sum(len(c.hashes[Kind(k)]) for (_, _, k), c in self.queue.items()) > self.cap:
            del self.queue[min(self.queue)]

    def expire(self, now: float) -> None:
        for entry in [e for e in self.queue if e[0] <= now]:
            del self.queue[entry]

    def withdraw(self, key: ReplicaKey, spec_id: int) -> None:
        rep = self.reps.get(key)
        for call in self.queue.values():
            if call.spec_id == spec_id and rep is not None and call.epoch == rep.epoch:
                call.withdrawn = True

    def dead_calls(self) -> set[tuple[float, int, int]]:
        """Queued entries of caches forgotten (cleared, removed): a compaction drops them."""
        return {
            e
            for e, c in self.queue.items()
            if c.key not in self.reps or self.reps[c.key].epoch != c.epoch
        }

    def compacted(self, dead: set[tuple[float, int, int]]) -> None:
        for entry in dead:
            self.queue.pop(entry, None)

    def speculated(self, key: ReplicaKey, kind: Kind) -> set[int]:
        rep = self.reps[key]
        out: set[int] = set()
        for (_, _, k), call in self.queue.items():
            if k != kind or call.key != key or call.epoch != rep.epoch or call.withdrawn:
                continue
            out.update(h for h in call.hashes[kind] if rep.settled.get((kind, h), -1) < call.tick)
        return out

    # -------------------------------------------------------------- answers

    def views(self, key: ReplicaKey) -> tuple[set[int], set[int], set[int], set[int]]:
        """(every KV block, GPU or speculated, GPU/CPU or speculated, checkpoints)."""
        rep = self.reps[key]
        spec = self.speculated(key, Kind.KV)
        gpu = rep.tiers[Tier.GPU] | spec
        host = gpu | rep.tiers[Tier.CPU]
        return host | rep.tiers[Tier.DISK], gpu, host, rep.state | self.speculated(key, Kind.STATE)

    def closed(self, parent: dict[int, int | None]) -> bool:
        """Every replica's views hold each block's parent (the index's bisection needs it)."""
        for key in self.reps:
            for view in self.views(key)[:3]:
                if any(parent[h] is not None and parent[h] not in view for h in view):
                    return False
        return True

    def match(self, hashes: list[int], hybrid: bool, opts: dict) -> dict[ReplicaKey, PrefixMatch]:
        limit = len(hashes)
        tokens, size = opts.get("prompt_tokens"), opts.get("block_size", 0)
        align, peek = max(opts.get("align_blocks", 1), 1), opts.get("peek_blocks", 0)
        if tokens is not None and size > 0:
            limit = min(limit, eagle_limit(tokens, size, peek > 0, hybrid))
        out = {}
        for key in self.reps:
            every, gpu_v, host_v, state = self.views(key)
            kv = prefix(hashes, every)
            if not kv:
                continue
            gpu = min(prefix(hashes, gpu_v), kv)
            host = max(gpu, min(prefix(hashes, host_v), kv))
            reach = kv
            if peek > 0 or align > 1:
                reach = max(floor_to(min(kv, limit), align) - peek, 0)
            elif not opts.get("fine_blocks"):
                reach = min(kv, limit)
            usable = reach
            if hybrid:
                top = min(reach, limit)
                usable = next((d for d in range(top, 0, -1) if hashes[d - 1] in state), 0)
            out[key] = PrefixMatch(kv, gpu, host, usable)
        return out


def prefix(hashes: list[int], held: set[int]) -> int:
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


KEYS = [ReplicaKey(f"r{i}", i % 2) for i in range(5)]


def run(seed: int, steps: int = 150) -> None:
    rng = random.Random(seed)
    n_nodes = rng.randint(6, 40)
    parent_of = [None] + [
        rng.choice([None, *range(i)]) if rng.random() < 0.85 else None for i in range(1, n_nodes)
    ]
    paths: list[list[int]] = []
    for i, p in enumerate(parent_of):
        paths.append((paths[p] if p is not None else []) + [i])
    hashes = [rng.getrandbits(63) - 2**62 for _ in range(n_nodes)]
    parent = {hashes[i]: (None if p is None else hashes[p]) for i, p in enumerate(parent_of)}
    chains = [[hashes[i] for i in path] for path in paths]
    cap = rng.choice([10**6, 12, 30])
    idx, ref = PrefixIndex(max_speculative_blocks=cap), Ref(cap)
    epochs: dict[int, int] = {}  # the reference's epoch -> the index's cache_epoch
    calls: list[Call] = []
    seqs: dict[ReplicaKey, int] = {}
    steps_iter = None
    dead: set[tuple[float, int, int]] = set()
    now = 0.0
    keys = KEYS[: rng.randint(1, len(KEYS))]

    def event() -> IndexEvent:
        chain = rng.choice(chains)
        kind = Kind.STATE if rng.random() < 0.25 else Kind.KV
        tier = (
            rng.choice([Tier.GPU, Tier.GPU, Tier.CPU, Tier.DISK]) if kind is Kind.KV else Tier.GPU
        )
        roll = rng.random()
        if roll < 0.06:
            return AllCleared()
        if roll < 0.55:
            if kind is Kind.STATE:
                return BlocksStored(
                    tuple(rng.sample(chain, rng.randint(1, min(2, len(chain))))), tier, kind
                )
            return BlocksStored(tuple(chain), tier, kind)
        tail = chain[-rng.randint(1, min(3, len(chain))) :]
        return BlocksRemoved(tuple(reversed(tail)), tier, kind)

    for step in range(steps):
        key = rng.choice(keys)
        roll = rng.random()
        now += rng.choice([0.0, 0.5, 3.0])
        if roll < 0.4:  # engine events, direct or in a sequenced batch
            events = tuple(event() for _ in range(rng.randint(1, 3)))
            trial = Ref(cap)
            trial.reps = {
                k: Rep(
                    r.epoch, {t: set(s) for t, s in r.tiers.items()}, set(r.state), dict(r.settled)
                )
                for k, r in ref.reps.items()
            }
            trial.queue = ref.queue
            trial.epochs, trial.ticks = itertools.count(10**9), itertools.count(next(ref.ticks))
            for ev in events:
                if isinstance(ev, AllCleared):
                    trial.clear(key)
                else:
                    trial.event(trial.rep(key), key, ev)
            if not trial.closed(parent):
                continue  # a hole: the index reports an upper bound there (documented)
            if (
                rng.random() < 0.5
                and all(not isinstance(e, AllCleared) for e in events)
                and len(events) == 1
            ):
                ev = events[0]
                if isinstance(ev, BlocksStored):
                    idx.store(key, list(ev.hashes), ev.tier, ev.kind)
                    ref.event(ref.rep(key), key, ev)
                elif key in ref.reps:
                    idx.remove(key, list(ev.hashes), ev.tier, ev.kind)
                    ref.event(ref.reps[key], key, ev)
            else:
                seq: int | None = None
                if rng.random() < 0.8:
                    seq = seqs.get(key, 0) + rng.choice([1, 1, 1, 1, 2, 0, -1])
                    seqs[key] = max(seq, seqs.get(key, 0))
                batch = EventBatch(key, events, seq)
                want = ref.apply(batch)
                assert idx.apply(batch) is want, (seed, step)
        elif roll < 0.45:
            idx.clear_replica(key)
            ref.clear(key)
        elif roll < 0.5:
            idx.remove_replica(key)
            ref.remove_replica(key)
            seqs.pop(key, None)
        elif roll < 0.52:
            idx.reset_sequence(key)
            ref.last_seq.pop(key, None)
            seqs[key] = rng.randint(0, 3)
        elif roll < 0.54:
            idx.add_replica(key)
            ref.rep(key)
        elif roll < 0.72:  # a dispatch speculated: a chain and a checkpoint or two in it
            chain = rng.choice(chains)
            chain = chain[: rng.randint(1, len(chain))]
            states = tuple(rng.sample(chain, rng.randint(0, min(2, len(chain)))))
            ttl = rng.choice([1.0, 5.0, 30.0])
            spec_id = idx.speculate(key, tuple(chain), states, now, ttl)
            rep = ref.rep(key)
            call = Call(
                spec_id,
                key,
                rep.epoch,
                next(ref.ticks),
                {Kind.KV: tuple(chain), Kind.STATE: states},
            )
            calls.append(call)
            ref.speculate(call, now + ttl)
        elif roll < 0.78 and calls:  # a dispatch withdrawn (maybe again, maybe stale)
            call = rng.choice(calls[-6:])
            idx.withdraw(call.key, call.spec_id, call.hashes[Kind.KV], call.hashes[Kind.STATE])
            ref.withdraw(call.key, call.spec_id)
        elif roll < 0.84:
            block = rng.choice(hashes)
            kind = rng.choice([Kind.KV, Kind.STATE])
            rep = ref.rep(key)
            held = block in (rep.state if kind is Kind.STATE else rep.tiers[Tier.GPU])
            assert idx.await_store(key, block, kind) is (not held), (seed, step)
            if not held:
                rep.awaited.add((kind, block))
        elif roll < 0.87:
            idx.compact()
            ref.compacted(ref.dead_calls())
            steps_iter = None
        else:
            idx.expire(now)
            ref.expire(now)
        # compaction in steps, alongside
        if steps_iter is None and rng.random() < 0.1:
            steps_iter = idx.compaction(chunk=rng.choice([1, 3, 50]))
            dead = ref.dead_calls()
        if steps_iter is not None and next(steps_iter, None) is None:
            steps_iter = None
            ref.compacted(dead)
        check(idx, ref, rng, chains, hashes, now, epochs, seed, step)
    idx.compact()
    ref.compacted(ref.dead_calls())
    idx.expire(now + 100.0)
    ref.expire(now + 100.0)
    check_leftovers(idx, ref)


def check(
    idx: PrefixIndex,
    ref: Ref,
    rng: random.Random,
    chains: list[list[int]],
    hashes: list[int],
    now: float,
    epochs: dict[int, int],
    seed: int,
    step: int,
) -> None:
    ref.expire(now)
    where = (seed, step)
    assert sorted(idx.replicas()) == sorted(ref.reps), where
    for key, rep in ref.reps.items():
        assert idx.replica_size(key) == (sum(map(len, rep.tiers.values())), len(rep.state)), where
        assert idx.evicted_blocks(key) == rep.evicted, where
        assert idx.publishes_state(key) is (key in ref.state_keys), where
        epoch = idx.cache_epoch(key)
        assert epochs.setdefault(rep.epoch, epoch) == epoch, where  # one per cache
        for kind, block in [(k, rng.choice(hashes)) for k in Kind] + sorted(rep.awaited)[:3]:
            assert idx.awaits(key, block, kind) is ((kind, block) in rep.awaited), where
    assert len(set(epochs.values())) == len(epochs), where  # never reused
    for _ in range(3):
        query = list(rng.choice(chains))
        query += [rng.getrandbits(60)] * rng.randint(0, 2)
        size = rng.choice([4, 16])
        align = rng.choice([1, 1, 2, 4])
        opts: dict = rng.choice(
            [
                {},
                {"fine_blocks": True},
                {
                    "prompt_tokens": len(query) * size - rng.randint(-3, 2 * size),
                    "block_size": size,
                },
                {
                    "prompt_tokens": len(query) * size - rng.randint(-3, 2 * size),
                    "block_size": size,
                    "align_blocks": align,
                    "peek_blocks": rng.choice([0, align]),
                },
            ]
        )
        if "prompt_tokens" in opts:
            opts["prompt_tokens"] = max(opts["prompt_tokens"], 1)
        for hybrid in (False, True):
            got = idx.match(query, hybrid=hybrid, now=now, **opts)
            want = ref.match(query, hybrid, opts)
            assert got.as_dict() == want, (where, hybrid, opts)
            keys = tuple(KEYS)
            columns = got.columns(idx.slots(keys))
            for i, key in enumerate(keys):
                m = want.get(key, PrefixMatch())
                assert tuple(int(c[i]) for c in columns) == tuple(m), (where, key)
                assert got.get(key) == m, where
            assert got.longest() == max((m.kv_blocks for m in want.values()), default=0), where
    spec = sum(len(ref.speculated(k, kind)) for k in ref.reps for kind in Kind)
    if not idx._dead:  # (entries of cleared replicas stay counted until compacted)
        assert idx.stats().speculative_entries == spec, where


def check_leftovers(idx: PrefixIndex, ref: Ref) -> None:
    """After a compaction nothing names a slot no replica holds."""
    live = idx._live
    for table in (*idx._kv, idx._state, *idx._spec):
        for value in table.values():
            mask = value if value >= 0 else 1 << ~value
            assert mask & ~live == 0
    for awaited in idx._awaited:
        assert all(mask & ~live == 0 for mask in awaited.values())
    assert all(live >> slot & 1 for _, slot in idx._spec_owner)
    assert not idx._spec_heap and idx._spec_queued == 0
    stats = idx.stats()
    assert stats.garbage_entries == 0 and stats.speculative_entries == 0
    assert stats.kv_entries == sum(len(s) for r in ref.reps.values() for s in r.tiers.values())
    assert stats.state_entries == sum(len(r.state) for r in ref.reps.values())
    assert stats.unique_kv_blocks == sum(
        len(set().union(*(r.tiers[t] for r in ref.reps.values()))) for t in Tier
    )


def test_the_index_agrees_with_the_reference_model() -> None:
    """Fixed seeds (thousands more, with longer runs, agree: run ``run`` by hand)."""
    for seed in range(24):
        run(seed)
