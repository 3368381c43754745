"""The hidden-input check of `fmoe train`: before any rank builds its model, every rank's resolved config,
layout and data fingerprint must agree (fmoe.parallel.agree, one all-gather of digests).

Under torchrun each rank parses its own flags: a rank started with another --seed or --lr would train a
diverged replica to exit 0, another --num-experts aborts inside gloo. Compared, they fail on every rank
with one line, e.g.

    ranks started with different inputs: ranks [0] and [1] disagree on config: config['seed']: 1234 on
    ranks [0], 7 on ranks [1]

Left out of the comparison, as they may differ per rank without changing what is trained: --metrics,
--loss-curve, --progress, --tensorboard-dir and the --wandb-* flags (read by rank 0 only),
--keep-host-memory (a rank's own allocator) and the paths of --data, --data-path and --tokenizer-model (a
copy of the same file may sit elsewhere on another node: its content is compared, as the fingerprint, and
--data-path's weights with it). --trace is compared as set or not (every
rank joins its gather) and --timeout is compared (a rank that gives up earlier fails the others).
--schedule-file is compared by the schedule it holds, not its path (`schedule_fingerprint`): ranks reading
two copies of one schedule agree, ranks reading different schedules fail before any P2P waits on them.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from fmoe.parallel.agreement import AgreementError, agree
from fmoe.train.config import TrainConfig
from fmoe.train.data_source import file_fingerprint
from fmoe.train.run_errors import RunError

PER_RANK = ("metrics", "loss_curve", "progress", "keep_host_memory", "data", "data_path", "tokenizer_model",
            "tensorboard_dir", "wandb_project", "wandb_exp_name", "wandb_save_dir")


def compared_config(tc: TrainConfig) -> dict[str, Any]:
    """The fields every rank must share (`tc.as_dict()` less PER_RANK; --trace as set or not;
    --schedule-file as `schedule_fingerprint`)."""
    out = {k: v for k, v in tc.as_dict().items() if k not in PER_RANK}
    out["trace"] = bool(tc.trace)
    out["schedule_file"] = schedule_fingerprint(tc)
    return out


def schedule_fingerprint(tc: TrainConfig) -> str | None:
    """What identifies --schedule-file's schedule (None without one): its placement, ranks, microbatches
    and the sha256 of its placement, paths and printed actions (the same for copies that differ only in
    comments or spacing)."""
    if tc.schedule_file is None:
        return None
    from fmoe.schedule import ScheduleError, load_schedule

    try:
        s = load_schedule(tc.schedule_file)
    except ScheduleError as exc:  # compared like any other value: the ranks that can read it name the others
        return f"unreadable ({str(exc).split(': ', 1)[-1]})"
    pl = s.placement
    digest = hashlib.sha256(f"{pl.stage_rank} {pl.paths} {pl.layer_chunk} {s.mb_path}\n{s}".encode())
    return f"{pl.kind} placement, pp {s.pp}, {s.m} microbatches, sha256 {digest.hexdigest()[:16]}"


def data_fingerprint(tc: TrainConfig) -> str:
    """What identifies the training data: "markov" (drawn from --seed and the sizes, compared in the
    config), a file's kind, size and the sha256 of its first and last SAMPLE_BYTES, or --data-path's
    weights and the same of each prefix's .bin and .idx; with the tokenizer file's."""
    tokenizer = (f"; tokenizer {file_fingerprint(tc.tokenizer_model)}"
                 if tc.tokenizer_model is not None and os.path.isfile(tc.tokenizer_model) else "")
    if tc.data_path is not None:
        from fmoe.train.documents import parse_data_path

        try:
            blend = parse_data_path(tc.data_path)
        except ValueError as exc:
            return f"unreadable ({exc})"
        return "; ".join(f"{w} x bin {file_fingerprint(p + '.bin')}, idx {file_fingerprint(p + '.idx')}"
                         for w, p in blend) + tokenizer
    if tc.data == "markov":
        return "markov" + tokenizer
    return f"{tc.data_kind} file of {file_fingerprint(tc.data)}" + tokenizer


def check_ranks_agree(tc: TrainConfig, layout: dict[str, Any]) -> None:
    """Collective over the world (a no-op without a process group): raises RunError on every rank, one
    line naming the ranks and fields that differ, unless all ranks share config, layout and data."""
    try:
        agree(config=compared_config(tc), layout=layout, data=data_fingerprint(tc))
    except AgreementError as exc:
        text = " ".join(line.strip() for line in str(exc).splitlines())
        raise RunError(f"ranks started with different inputs: {text}") from None
