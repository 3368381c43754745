"""Point-to-point and collectives under NCCL's matching rules, replayed on CPU (tests/nccl_rules.py).

The replay is checked first on logs built by hand, so that each rule is shown to fail on code that breaks
it; then on what the executor issues for every schedule, pp 2 and 4, fb overlap on and off; then on a
training step whose ranks share pipeline, expert and data groups."""

from __future__ import annotations

import pytest
import torch
from dist_utils import spawn
from nccl_rules import CommOp, recording, replay

from fmoe import schedule as S
from fmoe.schedule.execute import execute
from fmoe.schedule.options import ExecOptions


def _op(rank: int, k: int, kind: str, peer: int | None = None, tag: int = 0, comm=(0, 1),
        sig=((4,),)) -> CommOp:
    return CommOp(rank, k, kind, comm, peer, tag, sig if kind != "coll" else ("all_reduce",))


def _async(*ops: CommOp) -> list:
    """Issue every op, then wait for each in turn (what an executor does with posted receives)."""
    return [("issue", o) for o in ops] + [("wait", o) for o in ops]


def test_two_receives_facing_each_other_deadlock() -> None:
    """Both ranks post a receive before their send: on one P2P stream each receive holds up the send."""
    a = [_op(0, 0, "recv", 1, 7), _op(0, 1, "send", 1, 8)]
    b = [_op(1, 0, "recv", 0, 8), _op(1, 1, "send", 0, 7)]
    assert replay({0: _async(*a), 1: _async(*b)})[0].startswith("deadlock")
    b_ok = [_op(1, 0, "send", 0, 7), _op(1, 1, "recv", 0, 8)]  # the same messages in one order
    assert replay({0: _async(*a), 1: _async(*b_ok)}) == []


def test_messages_sent_in_another_order_than_received_are_a_mismatch() -> None:
    """NCCL matches the k-th send with the k-th receive whatever the tags: swapped same-shape messages
    would be delivered to the wrong buffers."""
    a = [_op(0, 0, "send", 1, 1), _op(0, 1, "send", 1, 2)]
    b = [_op(1, 0, "recv", 0, 2), _op(1, 1, "recv", 0, 1)]
    problems = replay({0: _async(*a), 1: _async(*b)})
    assert any(p.startswith("mismatch") for p in problems), problems


def test_collectives_on_two_groups_in_opposite_orders_hang_only_when_the_device_serialises() -> None:
    """Rank 0 all-reduces on group X then Y, rank 1 on Y then X: separate streams let both run, one
    queue per device (NCCL's rule for several communicators) deadlocks."""
    x, y = (0, 1), (0, 1, 2)
    logs = {0: _async(_op(0, 0, "coll", comm=x), _op(0, 1, "coll", comm=y)),
            1: _async(_op(1, 0, "coll", comm=y), _op(1, 1, "coll", comm=x)),
            2: _async(_op(2, 0, "coll", comm=y))}
    assert replay(logs, "nccl") == []
    assert replay(logs, "device")[0].startswith("deadlock")


def test_a_collective_one_rank_never_calls_is_reported() -> None:
    logs = {0: _async(_op(0, 0, "coll")), 1: []}
    assert any("only" in p for p in replay(logs))


def _schedules(pp: int) -> list[str]:
    names = [n for n in S.registry.NAMES if n != "dualpipe" or pp % 2 == 0]
    return names


def _executor_logs(rank: int, world: int, m: int) -> dict:
    """Every schedule with fb overlap on and off on the toy model of test_schedule_execute; the P2P calls
    and waits each run issued."""
    from test_schedule_execute import _data, _params, _program

    out = {}
    for name in _schedules(world):
        s = S.build(name, world, m)
        params, data = _params(max(s.placement.layer_chunk) + 1), _data(m)
        # an exchange in flight: an overlapped pair switches ops there, as with a real all-to-all
        programs = {st: _program(s, st, params, travelling=True) for st in s.placement.stages_of(rank)}
        for overlap in (True, False):
            with recording() as log:
                execute(s, rank, programs, lambda mb, data=data: data[mb],
                        options=ExecOptions(overlap=overlap))
            out[(name, overlap)] = log
        if name == "1f1b":  # as gloo runs it: receives leave the wire order (the negative control)
            with recording(order_matched=False) as log:
                execute(s, rank, programs, lambda mb, data=data: data[mb])
            out[(name, "gloo order")] = log
    return out


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8)])
def test_every_schedule_runs_under_nccl_matching_rules(pp: int, m: int, four_ranks: list[dict]) -> None:
    if pp == 4:  # on the 4 ranks the training-step test below uses too, started once for both
        values = [v["executor"] for v in four_ranks]
    else:
        values = [r.value for r in spawn(_executor_logs, pp, m, timeout_s=240)]
    failures = {}
    gloo = ("1f1b", "gloo order")
    # gloo's own order (receives posted as soon as asked for, fmoe.schedule.wire.tag_matched) would hang
    # under NCCL's rules: a gradient's receive posted before its forward's send holds that send up
    assert any(p.startswith("deadlock") for p in replay(dict(enumerate(v[gloo] for v in values)), "nccl"))
    for key in values[0]:
        if key == gloo:
            continue
        logs = dict(enumerate(v[key] for v in values))
        for model in ("nccl", "device"):
            problems = replay(logs, model)
            if problems:
                failures[(*key, model)] = problems[:2]
    assert not failures, failures


def _train_logs(rank: int, world: int, layout: dict) -> list:
    from fmoe.parallel import ParallelLayout, Topology
    from fmoe.train.config import TrainConfig
    from fmoe.train.evaluate import evaluate
    from fmoe.train.loop import Trainer, World

    tc = TrainConfig.from_sources("tiny", None, {
        **layout, "steps": 1, "progress": False, "markov_sequences": 64, "global_batch_size": 8,
        "micro_batch_size": 1, "seq_length": 16, "keep_host_memory": False, "eval_interval": 1,
        "eval_iters": 1})
    par = ParallelLayout(pp=tc.pp, ep=tc.ep, dp=tc.dp, cp=tc.cp, ep_over_cp=tc.ep_over_cp,
                         topology=Topology(world, world), device_type="cpu")
    trainer = Trainer(tc, World(rank, world, par, torch.device("cpu")))
    with recording() as log:
        trainer.step()
    with recording() as eval_log:  # evaluation: forward only over the pipeline (schedule/forward_only.py)
        evaluate(trainer)
    return [log, eval_log]


TRAIN_LAYOUTS = {  # P2P beside the expert all-to-alls with fb overlap; beside the data-parallel reductions;
    # adaptive pipe overlap: no layer pairs (each chunks its rows), so every pair runs forward first;
    # the ring's shifts and the all-to-alls of an expert group carved from the cp pair inside the phases of
    # paired microbatches, the reductions over dp x cp and the expert replicas after them
    "pp2-ep2-dualpipev": {"pp": 2, "ep": 2, "dp": 1, "schedule": "dualpipev"},
    "pp2-dp2-interleaved": {"pp": 2, "ep": 1, "dp": 2, "schedule": "interleaved"},
    "pp2-ep2-dualpipev-self-overlap": {"pp": 2, "ep": 2, "dp": 1, "schedule": "dualpipev",
                                       "pair_overlap": "self", "a2a_chunks": 2},
    "pp2-cp2-ep2-over-cp-dualpipev-mtp": {"pp": 2, "dp": 1, "context_parallel_size": 2,
                                          "expert_model_parallel_size": 2, "schedule": "dualpipev",
                                          "mtp": True},
}


def _four_rank_logs(rank: int, world: int) -> dict:
    """This rank's logs for the pp 4 executor test (m 8) and each TRAIN_LAYOUTS training step, one after
    the other: one start of the 4 ranks for them all (each start costs seconds per rank)."""
    return {"executor": _executor_logs(rank, world, 8),
            "train": {name: _train_logs(rank, world, layout) for name, layout in TRAIN_LAYOUTS.items()}}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    """Each of the 4 ranks' `_four_rank_logs`, by rank."""
    return [r.value for r in spawn(_four_rank_logs, 4, timeout_s=400)]


@pytest.mark.parametrize("name", list(TRAIN_LAYOUTS))
def test_a_training_step_orders_its_communicators_alike_on_every_rank(name: str,
                                                                      four_ranks: list[dict]) -> None:
    for part in (0, 1):  # the training step, then an evaluation
        logs = dict(enumerate(v["train"][name][part] for v in four_ranks))
        assert replay(logs, "nccl") == [], (name, part)
        assert replay(logs, "device") == [], (name, part)
