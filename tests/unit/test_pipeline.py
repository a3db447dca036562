"""The pipeline strategy's choices and refusals (:mod:`lit_ddp.strategies.pipeline`) without processes: which stages
a rank holds under each schedule, the microbatch counts each schedule runs, the bad arguments named in one line, the
tied weight's optimizer entries renamed. Whole pipelines under ``lit-ddp fit``: ``tests/system/test_pipeline.py``."""

from __future__ import annotations

import re

import pytest

from lit_ddp.models.parallelize import SCHEDULE_NAMES, check_schedule, stage_indices, stages_per_rank_for
from lit_ddp.strategies import PipelineStrategy
from lit_ddp.strategies.pipeline import SCHEDULES, _rename


@pytest.mark.parametrize(
    ("schedule", "given", "held"),
    [("GPipe", None, 1), ("1F1B", None, 1), ("Interleaved1F1B", None, 2), ("Interleaved1F1B", 3, 3),
     ("ZBVZeroBubble", None, 2), ("DualPipeV", 2, 2), ("LoopedBFS", None, 2)],
)  # fmt: skip
def test_stages_per_rank_follow_the_schedule(schedule: str, given: int | None, held: int) -> None:
    assert stages_per_rank_for(schedule, given) == held


@pytest.mark.parametrize(
    ("schedule", "pp", "pp_rank", "per_rank", "stages"),
    [("1F1B", 4, 2, 1, [2]), ("Interleaved1F1B", 2, 1, 2, [1, 3]), ("LoopedBFS", 2, 0, 3, [0, 2, 4]),
     ("ZBVZeroBubble", 2, 0, 2, [0, 3]), ("DualPipeV", 4, 1, 2, [1, 6])],
)  # fmt: skip
def test_a_rank_holds_a_loop_or_a_v_of_stages(schedule: str, pp: int, pp_rank: int, per_rank: int, stages) -> None:
    assert stage_indices(schedule, pp, pp_rank, per_rank) == stages


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"schedule": "Zigzag"}, f"schedule='Zigzag' is not one of {', '.join(SCHEDULE_NAMES)}"),
        ({"schedule": "1F1B", "stages_per_rank": 2}, "stages_per_rank=2: the 1F1B schedule runs exactly 1 stage(s)"),
        ({"schedule": "ZBVZeroBubble", "stages_per_rank": 3}, "the ZBVZeroBubble schedule runs exactly 2 stage(s)"),
        ({"schedule": "Interleaved1F1B", "stages_per_rank": 0}, "stages_per_rank=0: the Interleaved1F1B schedule runs"),
        ({"n_microbatches": 0}, "n_microbatches=0 must be >= 1"),
        ({"n_microbatches": 1, "pipeline_parallel_size": 2}, "n_microbatches=1: 1F1B needs at least one per stage"),
        ({"schedule": "DualPipeV", "n_microbatches": 3}, "n_microbatches=3: DualPipeV needs at least one per stage"),
        (
            {"schedule": "Interleaved1F1B", "n_microbatches": 9, "pipeline_parallel_size": 4},
            "n_microbatches=9: Interleaved1F1B over 4 ranks runs them in 2 rounds (n_microbatches // 4), which must",
        ),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size=0 must be >= 1"),
        ({"save_distributed_checkpoint": False}, "save_distributed_checkpoint=false: a single-file checkpoint"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2: give 1"),  # FSDP2Strategy's own refusals stand
    ],
)
def test_a_bad_argument_is_named_in_one_line(kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        PipelineStrategy(**kwargs)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("schedule", "pp", "m"), [("GPipe", 4, 1), ("1F1B", 2, 2), ("Interleaved1F1B", 4, 3), ("Interleaved1F1B", 4, 8)]
)
def test_microbatch_counts_the_schedules_run(schedule: str, pp: int, m: int) -> None:
    check_schedule(schedule, pp, m, stages_per_rank_for(schedule, None))


def test_every_schedule_name_is_torch_s() -> None:
    assert list(SCHEDULES) == list(SCHEDULE_NAMES)
    assert all(cls.__name__ == f"Schedule{name}" for name, cls in SCHEDULES.items())


def test_the_last_stage_s_copy_is_keyed_as_the_first_stage_s() -> None:
    head, embedding = "model.lm_head.weight", "model.transformer.wte.weight"
    assert _rename(f"state.{head}.exp_avg", head, embedding) == f"state.{embedding}.exp_avg"
    assert _rename(f"param_groups.{head}.lr", head, embedding) == f"param_groups.{embedding}.lr"
    assert _rename("state.model.lm_head.weight_extra.step", head, embedding) == "state.model.lm_head.weight_extra.step"
    assert _rename(f"state.{embedding}.step", head, embedding) == f"state.{embedding}.step"
