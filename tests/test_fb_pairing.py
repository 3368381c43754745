"""fb overlap pairs what seed 000 pairs, read from the executor's own timeline (no timing: the order of
events on one thread).

For every exchange of an F&B pair, the compute phases of the *other* microbatch that ran between its issue
and its wait are what hid it. Per pair of MoE layers (the forward's k-th with the backward's k-th, which
is the (n-1-k)-th in forward order):
  combine-B  hidden by  attention-F      dispatch-F  hidden by  mlp-B
  dispatch-B hidden by  mlp-F            combine-F   hidden by  attention-B
The shared expert rides on the exchanges of its own microbatch (its forward beside the dispatch, its
backward beside the combine), and the count exchange is no hand-over point. When the two stages hold
different numbers of MoE layers the first min(n_F, n_B) layer pairs pair like this and the longer op
runs its remaining layers alone; dense layers, the embedding, the head and MTP are compute that runs in
the turn they fall in. With overlap off nothing is paired. Sends: an activation goes out right after its
forward's last phase, a gradient right after its dx pass, before any dw and before the paired op ends.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import share_ranks, shared_ranks

from fmoe import GPTConfig, MoEConfig, init_gpt, init_gpt_state
from fmoe import schedule as S
from fmoe.parallel import AllToAllDispatcher, CommGroup, ParallelLayout, Topology
from fmoe.parallel.context import ParallelContext
from fmoe.pipeline import gpt_pipeline_step, gpt_program
from fmoe.schedule.ir import Overlap
from fmoe.schedule.options import ExecOptions
from fmoe.schedule.timeline import TraceEvent

E, EP = 4, 2
SEED = {("combine", "B"): ("attention", "F"), ("dispatch", "F"): ("mlp", "B"),
        ("dispatch", "B"): ("mlp", "F"), ("combine", "F"): ("attention", "B")}


def _cfg(n_layers: int, dense: int, mtp: bool = False) -> GPTConfig:
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=E, top_k=2, num_shared_experts=1)
    return GPTConfig(vocab_size=32, d_model=16, n_layers=n_layers, n_heads=2, moe=moe, num_dense_layers=dense,
                     mtp=mtp)


def _compute(e: TraceEvent) -> tuple | None:
    """(kind, phase, stage, layer, mb) of a compute event, else None."""
    return (e.kind, e.phase, e.stage, e.layer, e.microbatch) if e.kind in ("F", "B", "I", "W") else None


def _a2a(e: TraceEvent) -> tuple | None:
    """(phase, direction, stage, layer, mb) of an exchange's span or its wait, else None."""
    return (e.phase, e.direction, e.stage, e.layer, e.microbatch) if e.kind in ("a2a", "wait a2a") else None


def _waits(events: list[TraceEvent]) -> dict[tuple, float]:
    """When each exchange's wait began, by `_a2a`."""
    return {_a2a(e): e.start for e in events if e.kind == "wait a2a"}


def _events(rank: int, world: int, cases: list) -> dict:
    out = {}
    for key in cases:
        name, pp, n_layers, dense, overlap, *extra = key
        layout = ParallelLayout(pp=pp, ep=EP, topology=Topology(world, world))
        d = AllToAllDispatcher(CommGroup(layout.group("expert")), E)
        cfg = _cfg(n_layers, dense, mtp="mtp" in extra)
        ep_rank = torch.distributed.get_rank(layout.group("expert"))
        params = init_gpt(cfg, torch.Generator().manual_seed(0))
        for b in params["layers"][dense:] + ([params["mtp"]["block"]] if cfg.mtp else []):  # this EP rank's
            b["moe"]["experts"] = {k: v[ep_rank * E // EP:(ep_rank + 1) * E // EP].clone()
                                   for k, v in b["moe"]["experts"].items()}
        s = S.combined_1f1b(4) if name == "combined_1f1b" else S.build(name, pp, 4)
        g = torch.Generator().manual_seed(ep_rank)
        seqs = [torch.randint(0, 32, (2, 7), generator=g) for _ in range(4)]
        batches = [(t[:, :-1], t[:, 1:]) for t in seqs]
        pp_rank = torch.distributed.get_rank(layout.group("pp")) if pp > 1 else 0
        step = gpt_pipeline_step(gpt_program(cfg, s, pp_rank, parallel=ParallelContext(dispatcher=d)), params,
                                 init_gpt_state(cfg), batches, group=layout.group("pp") if pp > 1 else None,
                                 options=ExecOptions(overlap=overlap))
        pairs = [(a.f.stage, a.f.mb, a.b.stage, a.b.mb) for a in s.ranks[pp_rank] if isinstance(a, Overlap)]
        out[key] = (step.result.events, pairs)
    return out


def _pairs(run: tuple) -> list[dict]:
    """Per exchange of an F&B pair on this rank (the rank's events and its schedule's pairs): its op,
    phase, layer, and the compute phases of the pair's other op that ran while it was in flight (between
    its issue and its wait): {(kind, phase, layer)}."""
    events, pairs = run
    events = sorted(events, key=lambda e: e.start)
    waits = _waits(events)
    partner = {}
    for fs, fm, bs, bm in pairs:
        partner[("F", fs, fm)], partner[("B", bs, bm)] = ("B", bs, bm), ("F", fs, fm)
    compute = []
    for e in events:
        if e.lane == "compute" and (c := _compute(e)):
            k, ph, st, ly, mb = c
            compute.append(("F" if k == "F" else "B", st, mb, (k, ph, ly), e.start))
    out = []
    for e in events:
        m = _a2a(e)
        if e.lane != "comm" or not m or m[0] == "counts":
            continue
        phase, kind, stage, layer, mb = m
        other = partner.get((kind, stage, mb))
        if other is None:  # a lone op's exchange
            continue
        hid = {what for k, st, b, what, t in compute if (k, st, b) == other and e.start <= t < waits[m]}
        out.append({"phase": phase, "kind": kind, "op": (kind, stage, mb), "partner": other,
                    "layer": layer, "hid": hid})
    return out


def _check_seed_pairing(run: tuple) -> int:
    """Asserts seed 000's four pairings for every layer pair of every F&B pair of a rank's run; returns
    how many exchanges it checked."""
    by_pair: dict[tuple, list] = {}  # the pair's F op -> exchanges of both ops, in issue order
    for x in _pairs(run):
        by_pair.setdefault(x["op"] if x["kind"] == "F" else x["partner"], []).append(x)
    checked = 0
    for f_op, xs in by_pair.items():
        f_layers = list(dict.fromkeys(x["layer"] for x in xs if x["kind"] == "F"))  # forward order
        b_layers = list(dict.fromkeys(x["layer"] for x in xs if x["kind"] == "B"))  # backward order
        for k in range(min(len(f_layers), len(b_layers))):
            mine = {"F": f_layers[k], "B": b_layers[k]}
            for x in xs:
                if x["layer"] != mine[x["kind"]]:
                    continue
                want_phase, want_kind = SEED[(x["phase"], x["kind"])]
                want = (want_kind, want_phase, mine[want_kind])
                assert want in x["hid"], (f"pair {f_op} & {x['partner'] if x['kind'] == 'F' else x['op']}: "
                                          f"{x['phase']}-{x['kind']} of {x['layer']} hidden by "
                                          f"{sorted(x['hid'])}, not {want}")
                checked += 1
    return checked


CASES = {
    # pp 1 x ep 2, Megatron's combined 1F1B: F(i+1)&B(i) on the whole model, three MoE layers
    "combined": [("combined_1f1b", 1, 3, 0, True), ("combined_1f1b", 1, 3, 0, False)],
    # pp 2 x ep 2: DualPipeV (two MoE layers per chunk, pairs of different chunks), interleaved with the
    # extra warmup, unequal chunks with a dense layer (5 layers, the first dense, over 4 chunks), and MTP
    # (its MoE block one more layer in the last chunk, beside the head and loss)
    "pp2": [("dualpipev", 2, 8, 0, True), ("interleaved+extra", 2, 8, 0, True), ("dualpipev", 2, 5, 1, True),
            ("dualpipev", 2, 8, 0, True, "mtp"), ("dualpipev", 2, 8, 0, False)],
}


def _events_at(rank: int, world: int) -> dict:
    """`_events` for the cases of CASES that run at `world` ranks (EP x pp)."""
    return _events(rank, world, [c for cases in CASES.values() for c in cases if EP * c[1] == world])


# on the session's shared starts of the ranks (tests/dist_utils.py)
share_ranks("fb_pairing", (EP, 2 * EP), _events_at)


@pytest.fixture(scope="module")
def runs() -> dict:
    got = {}
    for cases in CASES.values():
        results = shared_ranks(EP * cases[0][1], "fb_pairing")
        for key in cases:
            got[key] = [r.value[key] for r in results]
    return got


@pytest.mark.parametrize("key", [c for cases in CASES.values() for c in cases if c[4]],
                         ids=lambda c: "-".join((c[0], f"pp{c[1]}", f"{c[2]}layers", f"{c[3]}dense", *c[5:])))
def test_every_layer_pair_pairs_as_seed_000(runs: dict, key: tuple) -> None:
    checked = sum(_check_seed_pairing(run) for run in runs[key])
    assert checked >= 8, checked  # pairs with MoE layers on both sides were found and checked


@pytest.mark.parametrize("key", [c for cases in CASES.values() for c in cases if not c[4]],
                         ids=lambda c: f"{c[0]}-pp{c[1]}")
def test_with_overlap_off_nothing_is_paired(runs: dict, key: tuple) -> None:
    for run in runs[key]:
        ex = _pairs(run)
        assert ex and all(not x["hid"] for x in ex), [x for x in ex if x["hid"]][:3]


@pytest.mark.parametrize("key", [("dualpipev", 2, 8, 0, True), ("dualpipev", 2, 5, 1, True),
                                 ("dualpipev", 2, 8, 0, True, "mtp")],
                         ids=["equal-chunks", "unequal-chunks", "mtp"])
def test_sends_go_out_the_moment_their_data_exists(runs: dict, key: tuple) -> None:
    """DualPipeV pp 2 x ep 2: a gradient's send follows its dx pass with no compute in between (no dw,
    nothing of the paired op), and an activation's follows its forward's last phase, also where the
    forward ends first (a backward with more MoE layers: 5 layers, the first dense, over 4 chunks), and
    its pair's gradient goes to the same rank: the wire order lists a pair's messages in the order they
    exist (`stage_turns`)."""
    checked = check_pair_sends_follow_their_data([events for events, _ in runs[key]])
    assert min(checked.values()) >= 2, checked


def check_pair_sends_follow_their_data(timelines: list[list[TraceEvent]]) -> dict[str, int]:
    """Asserts that every P2P send of an F&B pair in `timelines` (one per rank) follows, with no compute
    in between, the compute that made its data: an activation its forward's last phase, a gradient its
    dx pass; returns how many of each it checked."""
    checked = {"act": 0, "grad": 0}
    for events in timelines:
        events = sorted(events, key=lambda e: e.start)
        for i, e in enumerate(events):
            if not (e.lane == "comm" and e.kind == "p2p send" and e.step == "pair"):
                continue
            last = next(c for c in reversed(events[:i]) if c.lane == "compute" and _compute(c))
            own = last.kind in ("F" if e.what == "act" else "BI") and _compute(last)[2::2] == (e.stage,
                                                                                             e.microbatch)
            assert own, (e.name, last.name, events[i - 1].name)
            checked[e.what] += 1
    return checked


LONE = {("dispatch", "F"): ("F", "shared"), ("combine", "B"): ("B", "shared"),
        ("dispatch", "B"): ("W", "mlp")}


def test_lone_steps_hide_their_exchanges_with_their_own_work(runs: dict) -> None:
    """Warmup and cooldown (seed 000's lone rules): the shared expert's forward hides dispatch-F, its
    backward combine-B, and in a lone B (not an I, whose dw waits for its W) the routed experts' dw
    dispatch-B. combine-F of a lone F has nothing of its own op left to hide it (docs/pipeline.md says
    what could)."""
    checked = 0
    for key in (("combined_1f1b", 1, 3, 0, True), ("dualpipev", 2, 8, 0, True)):
        for events, _ in runs[key]:
            events = sorted(events, key=lambda e: e.start)
            waits = _waits(events)
            parsed = [(c, e.start) for e in events if e.lane == "compute" and (c := _compute(e))]
            for e in events:
                m = _a2a(e)
                if e.lane != "comm" or e.step != "lone" or not m or m[:2] not in LONE:
                    continue
                phase, kind, stage, layer, mb = m
                is_i = any(g[0] == "I" and (g[2], g[4]) == (stage, mb) for g, _ in parsed)
                if (phase, kind) == ("dispatch", "B") and is_i:
                    continue
                ran = {(g[0], g[1]) for g, t in parsed
                       if e.start <= t < waits[m] and g[2:] == (stage, layer, mb)}
                want_kind, want_phase = LONE[(phase, kind)]
                kinds = ("B", "I") if want_kind == "B" else (want_kind,)
                assert any((k, want_phase) in ran for k in kinds), (e.name, sorted(ran))
                checked += 1
    assert checked >= 6, checked


def test_the_count_exchange_travels_while_permute_1_runs(runs: dict) -> None:
    """Issued as soon as routing is known and waited where the dispatch needs it: every count exchange
    of a forward has its own op's permute-1 between its issue and its wait, and no hand-over. In a pair
    the shared expert's forward runs there too (the paired backward's mlp hides the dispatch; the count
    exchange, a sync with the EP peer, needs the slack); in a lone F it stays beside the dispatch."""
    checked = {"pair": 0, "lone": 0}
    for key in (("combined_1f1b", 1, 3, 0, True), ("dualpipev", 2, 8, 0, True)):
        for events, _ in runs[key]:
            events = sorted(events, key=lambda e: e.start)
            waits = _waits(events)
            for x in events:
                m = _a2a(x)
                if x.lane != "comm" or not m or m[:2] != ("counts", "F"):
                    continue
                _, _, stage, layer, mb = m
                ran = [c for e in events if x.start <= e.start < waits[m] and e.lane == "compute"
                       and (c := _compute(e))]
                want = [("F", "permute", stage, layer, mb)]
                if x.step == "pair":
                    want.append(("F", "shared", stage, layer, mb))
                assert ran == want, (x.name, x.step, ran)
                checked[x.step] += 1
    assert min(checked.values()) >= 3, checked


def test_a_pairs_messages_are_listed_in_the_order_the_executor_makes_them() -> None:
    """comms.forward_first_by_turns against the executor's turn taking, case by case: the backward
    starts and the two alternate at their turns, so the op with fewer turns ends first (a tie: the
    backward); a backward without turns runs whole at the forward's first; overlap off runs the forward
    whole first. And the derived sends follow it."""
    from fmoe.schedule.comms import forward_first_by_turns, sends

    pair = Overlap(S.Op("F", 0, 1), S.Op("B", 3, 0))
    cases = {(4, 4): False, (2, 4): True, (4, 2): False, (0, 4): True, (4, 0): False, (0, 0): True}
    for (tf, tb), want in cases.items():
        assert forward_first_by_turns({0: tf, 3: tb})(pair) is want, (tf, tb)
    assert forward_first_by_turns({0: 4, 3: 4}, overlap=False)(pair) is True
    assert forward_first_by_turns(None) is None
    s = S.build("dualpipev", 2, 4)
    pairs = [a for a in s.ranks[0] if isinstance(a, Overlap)]
    both = [a for a in pairs if len(sends(s, a)) == 2]  # F0.x&B3.y: an activation and a gradient to r1
    assert both
    for a in both:
        assert [snd.what for snd in sends(s, a)] == ["grad", "act"]
        for turns, want in (({0: 2, 1: 2, 2: 2, 3: 4}, ["act", "grad"]),
                            ({0: 4, 1: 2, 2: 2, 3: 4}, ["grad", "act"])):
            assert [snd.what for snd in sends(s, a, forward_first_by_turns(turns))] == want, (str(a), turns)


def test_stage_turns_that_disagree_with_the_programs_are_refused() -> None:
    cfg = _cfg(4, 0)
    s = S.build("1f1b", 1, 2)  # one rank: no process group needed
    params = init_gpt(cfg, torch.Generator().manual_seed(0))
    batches = [(torch.zeros(1, 4, dtype=torch.long),) * 2] * 2
    from fmoe.schedule.execute import execute
    programs = gpt_program(cfg, s, 0).stage_programs(params, (1, 4))
    data = {"ids_BS": batches[0][0], "targets_BS": batches[0][1]}
    with pytest.raises(S.ScheduleError, match="stage_turns says stage 0 hands over at 2 exchanges, its "
                                              "program at 0"):
        execute(s, 0, programs, lambda mb: data, stage_turns={0: 2})
    with pytest.raises(S.ScheduleError, match="stage_turns covers stages"):
        execute(s, 0, programs, lambda mb: data, stage_turns={0: 0, 1: 0})
