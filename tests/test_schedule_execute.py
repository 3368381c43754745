"""The generic executor on a toy model: every generator, real gloo ranks, against torch.func.vjp of the
whole model run microbatch after microbatch in one process (the oracle never touches the executor)."""

from __future__ import annotations

import datetime
import gc
import json
import re
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from dist_utils import RankResult, share_ranks, shared_ranks, spawn

from fmoe import schedule as S
from fmoe.ops import linear
from fmoe.schedule.execute import execute
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.timeline import TraceEvent
from fmoe.transforms.program import Layer, Phase, Ready, StageProgram

D, T = 8, 6


def _params(num_chunks: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"c{c}": {"w": torch.randn(D, D, generator=g, dtype=torch.float64, device="cpu") / D ** 0.5,
                      "b": torch.randn(D, generator=g, dtype=torch.float64, device="cpu")}
            for c in range(num_chunks)}


def _data(m: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(T, D, generator=g, dtype=torch.float64, device="cpu"),
             "y": torch.randn(T, D, generator=g, dtype=torch.float64, device="cpu")} for _ in range(m)]


def _chunk(p: dict, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(linear(h, p["w"]) + p["b"])


class _Travelling(Ready):
    """A Pending the executor treats as in flight: an fb-overlap pair switches ops at it."""

    in_flight = True


def _doubling(local: bool = False, travelling: bool = False) -> Phase:
    """A linear comm phase (x2 there, x2 back), so the executor's exchange path runs without a group."""
    pending = _Travelling if travelling else Ready
    return Phase("double", "comm", start=lambda a, m: pending(({"h": 2 * a["h"]}, m)),
                 start_transpose=lambda ct, m: pending({"h": 2 * ct["h"]}), local=local)


def _program(s: S.Schedule, stage: int, params: dict, local: bool = False,
             travelling: bool = False) -> StageProgram:
    chunk = s.placement.layer_chunk[stage]
    first = {s.path(mb)[0] for mb in range(s.m)}
    last = {s.path(mb)[-1] for mb in range(s.m)}
    key = f"c{chunk}"

    def body(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:  # p: {key: the chunk's params}
        h = meta["x"] if stage in first else acts["h"]
        return {"h": _chunk(p[key], h)}, meta

    def loss(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        return {"mse": ((acts["h"] - meta["y"]) ** 2).mean()}, meta

    phases = [Phase("body", "compute", fn=body, param_paths=((key,),)), _doubling(local, travelling)]
    if stage in last:
        phases.append(Phase("loss", "compute", fn=loss, losses=("mse",)))
    spec = {} if stage in first else {"h": ((T, D), torch.float64)}
    return StageProgram(stage, (Layer(f"L{chunk}", tuple(phases)),), {key: params[key]}, spec)


def _oracle(s: S.Schedule, params: dict) -> tuple[float, dict]:
    data = _data(s.m)

    def total(p: dict) -> torch.Tensor:
        out = 0.0
        for mb in range(s.m):
            h = data[mb]["x"]
            for st in s.path(mb):
                h = 2 * _chunk(p[f"c{s.placement.layer_chunk[st]}"], h)
            out = out + ((h - data[mb]["y"]) ** 2).mean()
        return out / s.m

    loss, vjp = torch.func.vjp(total, params)
    return float(loss), vjp(torch.ones(()))[0]


def _rank(rank: int, world: int, names: tuple[str, ...], m: int) -> dict:
    out = {}
    for name in names:  # one spawn runs every schedule: process start-up dominates at these sizes
        s = S.build(name, world, m)
        params = _params(max(s.placement.layer_chunk) + 1)
        data = _data(m)
        # the exchange in flight, as an all-to-all would be: an fb-overlap pair interleaves its two ops,
        # so both microbatches' activations live at once, as the simulator counts them (with nothing in
        # flight the pair's backward would run and free its activations before the forward starts)
        programs = {st: _program(s, st, params, travelling=True) for st in s.placement.stages_of(rank)}
        res = execute(s, rank, programs, lambda mb, data=data: data[mb])
        sim = S.simulate(s, S.Costs(f=1, i=1, w=1))
        grads = {c: {k: v.tolist() for k, v in g.items()} for c, g in res.grads.items()}  # no shared memory
        out[name] = (float(res.loss), grads, res.peak_activations, sim.peak_activations[rank])
    return out


CASES = {2: (S.registry.NAMES, 4), 4: (("1f1b", "interleaved", "dualpipev"), 8)}


TRAPPED = ("1f1b", "zb_h1", "dualpipev")  # the schedules run under the default-device trap, on 2 ranks
UNTAGGED = {2: ("interleaved", "interleaved+extra"), 4: ("interleaved", "zbv", "dualpipev")}  # tags all 0


def _all_parts(rank: int, world: int) -> dict:
    """This rank's answers for every spawned test of this file that runs at `world` ranks (2 or 4), by part,
    one after the other: one start of the ranks for them all (a rank's start costs seconds)."""
    names, m = CASES[world]
    out = {"plain": _rank(rank, world, names, m), "untagged": _untagged_rank(rank, world, UNTAGGED[world],
                                                                             2 * world)}
    if world == 2:
        out["trapped"] = _trapped_rank(rank, world, TRAPPED, 4)
        out["grad_posts"] = _grad_posts(rank, world)
    return out


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("schedule_execute", tuple(CASES), _all_parts)


@pytest.fixture(scope="module")
def ranks_at() -> Callable[[int, str], list[RankResult]]:
    """`ranks_at(world, part)`: each rank's RankResult of `_all_parts` at `world` ranks, its value the
    answer for `part`."""
    return lambda world, part: shared_ranks(world, "schedule_execute", part)


@pytest.mark.parametrize("pp", sorted(CASES))
def test_every_schedule_matches_the_single_process_oracle(pp: int, ranks_at: Callable) -> None:
    names, m = CASES[pp]
    _check_against_oracle(ranks_at(pp, "plain"), names, pp, m)


def test_the_executor_allocates_on_the_device_of_its_stages(ranks_at: Callable) -> None:
    """Under the default-device trap (tests/device_trap.py: default device `meta`, data and params on CPU)
    a receive buffer or a loss sum made without a device fails; the results are the oracle's."""
    _check_against_oracle(ranks_at(2, "trapped"), TRAPPED, 2, 4)


def _trapped_rank(rank: int, world: int, names: tuple[str, ...], m: int) -> dict:
    from device_trap import default_device_trap

    with default_device_trap():
        return _rank(rank, world, names, m)


@pytest.mark.parametrize(("pp", "names"), sorted(UNTAGGED.items()))
def test_every_schedule_is_right_when_messages_match_by_order_alone(pp: int, names: tuple[str, ...],
                                                                    ranks_at: Callable) -> None:
    """Every P2P tag forced to 0: gloo then matches each pair's messages in the order they were posted, as
    NCCL and HCCL do whatever the tag. A receiver that took two messages in another order than they were
    sent would get them swapped (same shapes, wrong gradients), as these schedules did before the wire
    order."""
    _check_against_oracle(ranks_at(pp, "untagged"), names, pp, 2 * pp)


def _untagged_rank(rank: int, world: int, names: tuple[str, ...], m: int) -> dict:
    import torch.distributed as dist

    from fmoe.schedule import wire

    isend, irecv = dist.isend, dist.irecv
    dist.isend = lambda *a, **k: isend(*a, **{**k, "tag": 0})
    dist.irecv = lambda *a, **k: irecv(*a, **{**k, "tag": 0})
    matched, wire.TAG_MATCHED_BACKENDS = wire.TAG_MATCHED_BACKENDS, ()  # the executor is told: by order
    try:
        return _rank(rank, world, names, m)
    finally:
        dist.isend, dist.irecv = isend, irecv
        wire.TAG_MATCHED_BACKENDS = matched


def _check_against_oracle(results: list, names: tuple[str, ...], pp: int, m: int) -> None:
    for name in names:
        s = S.build(name, pp, m)
        want_loss, want = _oracle(s, _params(max(s.placement.layer_chunk) + 1))
        got_loss = sum(r.value[name][0] for r in results)
        assert got_loss == pytest.approx(want_loss, rel=1e-12), name
        summed: dict = {}
        for r in results:
            for c, g in r.value[name][1].items():
                for k, v in g.items():
                    v = torch.tensor(v, dtype=torch.float64)
                    summed.setdefault(c, {}).setdefault(k, torch.zeros_like(v)).add_(v)
        assert summed.keys() == want.keys(), name
        for c in want:
            for k in want[c]:
                torch.testing.assert_close(summed[c][k], want[c][k], rtol=1e-10, atol=1e-12, msg=name)
        for r in results:
            assert r.value[name][2] == r.value[name][3], f"{name} rank {r.rank}: peak activations"


@pytest.mark.parametrize(("name", "local", "overlap", "fuse", "deferred"), [
    ("1f1b", True, True, True, False),    # a B, every exchange local: nothing to hide the dw behind
    ("1f1b", False, False, True, False),  # a B with overlap off: the dw would run right after anyway
    ("1f1b", False, True, True, True),    # a lone B hides its exchanges behind the dw it has: deferred
    ("zb_h1", True, True, False, True),   # I and W run as listed: deferred
    ("zb_h1", True, True, True, False),   # on one rank each W follows its I: they run as one B
])
def test_a_b_with_nothing_to_hide_computes_its_weight_grads_in_the_dx_pass(
        monkeypatch, name: str, local: bool, overlap: bool, fuse: bool, deferred: bool) -> None:
    """One rank, three microbatches: the weight gradients are those of the oracle either way; they go on
    the weight-grad tape only where the schedule or an exchange can use the delay."""
    from fmoe.transforms.tape import WeightGradTape

    recorded = []
    record = WeightGradTape.record

    def counting(self, *args, **kwargs):
        recorded.append(1)
        return record(self, *args, **kwargs)

    monkeypatch.setattr(WeightGradTape, "record", counting)
    s = S.build(name, 1, 3)
    params, data = _params(1), _data(3)
    res = execute(s, 0, {0: _program(s, 0, params, local)}, lambda mb: data[mb],
                  options=ExecOptions(overlap=overlap, fuse_iw=fuse))
    want_loss, want = _oracle(s, params)
    assert float(res.loss) == pytest.approx(want_loss, rel=1e-12)
    for k in want["c0"]:
        torch.testing.assert_close(res.grads["c0"][k], want["c0"][k], rtol=1e-10, atol=1e-12)
    assert (len(recorded) == 3) if deferred else not recorded, len(recorded)
    kinds = {e.cat for e in res.events if e.lane == "compute"}
    if name == "zb_h1":  # the timeline shows what ran: I and W, or the B they became
        assert ({"I", "W"} <= kinds and "B" not in kinds) if not fuse else ("B" in kinds and "I" not in kinds)


def test_gradient_sums_never_write_into_a_tensor_they_did_not_allocate() -> None:
    """The executor sums microbatch gradients in place, but only into sums it made: a dw pass's output
    (which may alias something its caller holds) is never written."""
    from fmoe.schedule.execute import _add_at

    for dtype in (None, torch.float64):
        tree: dict = {}
        owned: set = set()
        parts = [torch.full((2,), float(k + 1), dtype=torch.float32) for k in range(4)]
        for g in parts:
            _add_at(tree, ("block", "w"), {"a": g}, dtype, owned)
        assert [float(g[0]) for g in parts] == [1.0, 2.0, 3.0, 4.0]
        got = tree["block"]["w"]["a"]
        assert got.dtype == (dtype or torch.float32) and got.tolist() == [10.0, 10.0]


def test_summed_gradients_are_kept_not_added_again() -> None:
    """A dx pass that added into the sums it was given (split_vjp's `into`) hands back those sums, which
    are not added again, and fresh gradients, which become (or are added into) the sums: the first kept
    as it is, an unowned sum from another pass never written."""
    from fmoe.schedule.execute import _add_at

    tree: dict = {}
    owned: set = set()
    path = ("block", "w")
    fresh = torch.full((2,), 1.0)
    _add_at(tree, path, fresh, None, owned, summed=True)  # the first microbatch: kept, no copy
    assert tree["block"]["w"] is fresh and path in owned
    fresh.add_(2.0)  # what the next dx pass does to the sum it is given
    _add_at(tree, path, fresh, None, owned, summed=True)
    assert tree["block"]["w"] is fresh and fresh.tolist() == [3.0, 3.0]
    other = torch.full((2,), 5.0)  # a deferred thunk's output: not owned
    tree2: dict = {}
    owned2: set = set()
    _add_at(tree2, path, other, None, owned2)
    _add_at(tree2, path, torch.full((2,), 1.0), None, owned2, summed=True)
    assert other.tolist() == [5.0, 5.0] and tree2["block"]["w"].tolist() == [6.0, 6.0] and path in owned2


def test_programs_that_do_not_match_the_placement_fail_before_running() -> None:
    s = S.one_f_one_b(2, 2)
    params = _params(2)
    with pytest.raises(S.ScheduleError, match="places stages \\[0\\]"):
        execute(s, 0, {1: _program(s, 1, params)}, lambda mb: _data(2)[mb])
    wrong = _program(s, 1, params)
    with pytest.raises(S.ScheduleError, match="says it is stage 1"):
        execute(s, 0, {0: wrong}, lambda mb: _data(2)[mb])


def test_integer_acts_are_rejected_with_the_phase_named() -> None:
    s = S.one_f_one_b(1, 1)
    bad = Phase("ids", "compute", fn=lambda p, a, m: ({"ids": m["x"].long()}, m))
    with pytest.raises(S.ScheduleError, match="L0 ids: acts\\['ids'\\] is not a floating tensor"):
        execute(s, 0, {0: StageProgram(0, (Layer("L0", (bad,)),), {})}, lambda mb: _data(1)[mb])


def test_measured_timeline_names_lanes_and_writers(tmp_path) -> None:
    s = S.one_f_one_b(1, 2)
    params = _params(1)
    res = execute(s, 0, {0: _program(s, 0, params)}, lambda mb: _data(2)[mb])
    names = [e.name for e in res.events]
    assert "F body s0 L0 mb1" in names and "B body s0 L0 mb0" in names and "W body s0 L0 mb1" in names
    assert "a2a double-F s0 L0 mb0" in names and "wait a2a double-B s0 L0 mb1" in names
    lanes = {e.name: e.lane for e in res.events}
    assert lanes["a2a double-F s0 L0 mb0"] == "comm" and lanes["wait a2a double-F s0 L0 mb0"] == "compute"
    assert all(0 <= e.start <= e.end for e in res.events)
    assert res.peak_activations == 1 and res.peak_deferred == 1
    trace = json.loads(S.write_trace(res.events, tmp_path / "t.json", us_per_unit=1e6).read_text())
    meta = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["name"] == "thread_name"}
    assert meta == {(0, 0): "compute", (0, 1): "comm"}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(res.events) and all(e["dur"] >= 0 for e in xs)
    assert S.write_png(res.events, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


class _Slow(Ready):
    """A Pending whose wait takes 4 ms (an exchange still travelling when the op waits for it)."""

    in_flight = True

    def wait(self) -> object:
        time.sleep(0.004)
        return self.value


def test_an_untraced_step_records_no_timeline_and_still_counts_its_waits() -> None:
    """ExecOptions(trace=False): no events, the same loss and gradients, and StepResult.waited still the
    time spent waiting (traced, it is the "wait" events' total: what `fmoe train` reports every step)."""
    s = S.one_f_one_b(1, 2)
    params = _params(1)
    prog = _program(s, 0, params)
    slow = Phase("slow", "comm", start=lambda a, m: _Slow(({"h": 2 * a["h"]}, m)),
                 start_transpose=lambda ct, m: _Slow({"h": 2 * ct["h"]}))
    layer = prog.layers[0]
    prog = StageProgram(0, (Layer(layer.name, tuple(slow if ph.name == "double" else ph
                                                    for ph in layer.phases)),), prog.params, prog.in_spec)
    traced = execute(s, 0, {0: prog}, lambda mb: _data(2)[mb])
    quiet = execute(s, 0, {0: prog}, lambda mb: _data(2)[mb], options=ExecOptions(trace=False))
    waits = [e for e in traced.events if e.cat == "wait"]
    assert len(waits) == 4 and traced.waited == pytest.approx(sum(e.duration for e in waits), rel=1e-9)
    assert quiet.events == [] and quiet.waited >= 4 * 0.004
    assert float(quiet.loss) == float(traced.loss)
    assert all(torch.equal(quiet.grads[k]["w"], traced.grads[k]["w"]) for k in traced.grads)


def _grad_posts(rank: int, world: int) -> dict[str, list]:
    """1F1B's timeline on this rank with every receive asked for at the start of the step, the receives
    kept in the wire order ("wire", what NCCL needs) and as gloo runs it by default ("early")."""
    from fmoe.schedule import wire

    s = S.one_f_one_b(2, 4)
    params = _params(2)
    out = {mode: execute(s, rank, {rank: _program(s, rank, params)}, lambda mb: _data(4)[mb],
                         options=ExecOptions(recv_ahead=100, early_recv=mode == "early")).events
           for mode in ("wire", "early")}
    matched, wire.TAG_MATCHED_BACKENDS = wire.TAG_MATCHED_BACKENDS, ()  # a transport that matches by order
    try:
        execute(s, rank, {rank: _program(s, rank, params)}, lambda mb: _data(4)[mb],
                options=ExecOptions(early_recv=True))
    except ValueError as err:
        out["refused"] = str(err)
    finally:
        wire.TAG_MATCHED_BACKENDS = matched
    return out


def test_receives_go_out_in_the_wire_order_as_early_as_it_lets_them(ranks_at: Callable) -> None:
    """With a lookahead that reaches back to the start of the step, every P2P op goes out in the wire order
    (what NCCL needs, tests/test_nccl_rules.py), and a receive right after the op before it on the wire:
    no compute runs in between (its gradient's shapes came from a forward that ran earlier)."""
    from fmoe.schedule.wire import wire_order

    events = next(r.value for r in ranks_at(2, "grad_posts") if r.rank == 0)["wire"]
    p2p = sorted((e for e in events if e.kind in ("p2p send", "p2p recv")), key=lambda e: e.start)
    assert all(e.lane == "comm" and e.peer == 1 for e in p2p)
    for e in events:  # the typed fields say what the name shows
        if e.kind in ("p2p send", "p2p recv", "wait p2p"):
            to = f" r{e.peer}" if e.kind == "p2p send" else ""
            assert e.name == f"{e.kind} {e.what} s{e.stage} mb{e.microbatch}{to}", e

    def short(e: TraceEvent) -> str:  # p2p recv of grad s1 mb0 -> "rg1.0"; p2p send of act s0 mb2 -> "sa0.2"
        return f"{e.kind[4]}{e.what[0]}{e.stage}.{e.microbatch}"

    want = [str(a).split(">")[0].split("<")[0] for a in wire_order(S.verify(S.one_f_one_b(2, 4)))[0]]
    assert [short(e) for e in p2p] == want
    assert any(w.startswith("rg") for w in want[:-2])  # gradients are received before the last send
    for before, post in zip(p2p, p2p[1:]):
        if post.kind == "p2p recv":
            ran = [e.name for e in events if e.lane == "compute" and before.start < e.start < post.start]
            assert not ran, (post.name, ran)


def test_on_gloo_receives_go_out_when_asked_for_and_sends_keep_the_wire_order(ranks_at: Callable) -> None:
    """Gloo matches messages by tag (fmoe.schedule.wire.tag_matched), so there a receive asked for leaves
    the wire order and goes out at once: with every receive asked for at the start of the step, each rank
    posts every receive whose shapes it knows before its first send (the last stage all of its activation
    receives; the first stage each gradient receive once its forward ran, before that forward's send), so
    no receive queues behind a send on the pair. The sends go out in the wire order all the same."""
    from fmoe.schedule.wire import wire_order

    wire = wire_order(S.verify(S.one_f_one_b(2, 4)))
    for r in ranks_at(2, "grad_posts"):
        events = r.value["early"]
        p2p = sorted((e for e in events if e.kind in ("p2p send", "p2p recv")), key=lambda e: e.start)
        got = [f"{e.kind[4]}{e.what[0]}{e.stage}.{e.microbatch}" for e in p2p]
        want = [str(a).split(">")[0].split("<")[0] for a in wire[r.rank]]
        assert sorted(got) == sorted(want) and got != want, (r.rank, got)
        assert [g for g in got if g[0] == "s"] == [w for w in want if w[0] == "s"], (r.rank, got)
        if r.rank == 1:  # activations: shapes known from the stage's input spec
            assert all(g[0] == "r" for g in got[:4]), got
        else:  # a gradient's receive goes out when its forward gave the shapes, before the forward's send
            for mb in range(4):
                assert got.index(f"rg1.{mb}") < got.index(f"sa0.{mb}"), got


def test_early_receives_are_refused_where_messages_match_by_order(ranks_at: Callable) -> None:
    """Asked for explicitly on a transport that matches by issue order (NCCL, HCCL; here gloo declared
    so), early receives are refused before anything is issued: there they would hang or swap messages."""
    for r in ranks_at(2, "grad_posts"):
        assert "early_recv=True on gloo, which matches messages by issue order" in r.value["refused"]


def _dies(rank: int, world: int) -> None:
    if rank == 1:
        raise SystemExit("rank 1 stops before its first send")
    s = S.one_f_one_b(2, 2)
    params = _params(2)
    execute(s, rank, {0: _program(s, 0, params)}, lambda mb: _data(2)[mb],
            options=ExecOptions(timeout=datetime.timedelta(seconds=20)))


def test_a_dead_peer_fails_the_step_naming_it_in_bounded_time() -> None:
    t0 = time.monotonic()
    results = spawn(_dies, 2, timeout_s=60, check=False)
    assert time.monotonic() - t0 < 60
    err = results[0].error or ""
    # rank 0 fails at its first P2P call with the dead rank: the send of mb 1 or a receive, either way named
    assert re.search(r"(from|to) pipeline rank 1 failed", err), err



def test_a_phase_gets_the_users_tree_below_its_root() -> None:
    """Phase.run hands fn its weights as the tree the user wrote below param_root (program.nested)."""
    from fmoe.transforms.program import nested

    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    root = ("layers", "3")
    got = nested(root, ((*root, "w_q"), (*root, "moe", "router")), (a, {"w": b}))
    assert got.keys() == {"w_q", "moe"} and got["w_q"] is a and got["moe"]["router"]["w"] is b
    assert nested(root, (root,), (c,)) is c  # the path is the root: its subtree itself
    assert nested((), (), ()) == {}
    got = nested((), (("norm",), ("head", "w"), ("mtp", "norm")), (a, b, c))
    assert got["norm"] is a and got["head"]["w"] is b and got["mtp"]["norm"] is c
    with pytest.raises(ValueError, match="given twice"):
        nested((), (("w",), ("w",)), (a, b))
    with pytest.raises(ValueError, match="not below param_root"):
        Phase("x", "compute", fn=lambda p, a_, m: (a_, m), param_paths=(("other", "w"),), param_root=root)
    seen = {}
    ph = Phase("x", "compute", fn=lambda p, a_, m: (seen.update(p) or a_, m),
               param_paths=((*root, "w_q"),), param_root=root)
    ph.run((a,), {}, {})
    assert seen == {"w_q": a}


def test_nothing_of_a_step_outlives_it_without_the_cycle_collector():
    """A phased stage (its exchange not local) on one rank: B defers its dw passes and adds them into the
    step's sums. With the cycle collector off, once the caller drops the StepResult nothing of the step is
    left: not the input each microbatch's deferred weight gradient read, not the gradient sums (no
    reference cycle through a dw pass, or through the executor that holds the sums, keeps them until a
    collection: memory every step would carry)."""
    s = S.build("1f1b", 1, 3)
    params, data = _params(1), _data(3)
    inputs = []

    def body(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        x = meta["x"] * 1.0  # only this microbatch's passes hold it: linear's deferred dw reads it
        inputs.append(weakref.ref(x))
        return {"h": _chunk(p["c0"], x)}, meta

    def loss(p: dict, acts: dict, meta: dict) -> tuple[dict, dict]:
        return {"mse": ((acts["h"] - meta["y"]) ** 2).mean()}, meta

    layer = Layer("L0", (Phase("body", "compute", fn=body, param_paths=(("c0",),)), _doubling(),
                         Phase("loss", "compute", fn=loss, losses=("mse",))))
    program = StageProgram(0, (layer,), {"c0": params["c0"]}, {})
    gc.collect()
    gc.disable()
    try:
        res = execute(s, 0, {0: program}, lambda mb: data[mb])
        loss_value = float(res.loss)
        refs = inputs + [weakref.ref(g) for g in res.grads["c0"].values()]
        del res
        alive = [ref() is not None for ref in refs]
    finally:
        gc.enable()
    assert len(refs) == 5 and not any(alive), alive
    assert loss_value == pytest.approx(_oracle(s, {"c0": params["c0"]})[0], rel=1e-12)


def test_a_side_phase_is_given_the_acts_it_names() -> None:
    """Phase.side_reads: run_phases hands the side those acts only (all of them when it names none);
    naming them without a side is refused."""
    from fmoe.transforms.program import run_phases

    seen: list[set] = []
    side = Phase("side", "compute", fn=lambda p, a, m: (seen.append(set(a)) or {"s": a["x"] * 2}, m))

    def exchange(reads):
        return Phase("ex", "comm", start=lambda a, m: Ready((a, m)), start_transpose=lambda c, m: Ready(c),
                     side=side, side_reads=reads, local=True)

    for reads, want in ((("x",), {"x"}), ((), {"x", "y"})):
        got = run_phases((Layer("l", (exchange(reads),)),), lambda ph: (), {"x": torch.ones(2),
                                                                          "y": torch.zeros(2)}, {})
        assert seen.pop() == want and torch.equal(got.acts["s"], torch.full((2,), 2.0))
    with pytest.raises(ValueError, match="side_reads"):
        Phase("ex", "comm", start=lambda a, m: Ready((a, m)), start_transpose=lambda c, m: Ready(c),
              side_reads=("x",))
