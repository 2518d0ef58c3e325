"""A drafter's schedule under ``--minutes`` (``examples/training/common.py``): cut once, after the
warm-up, to the steps the measured rate fits; never lengthened; untouched without a budget."""

import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "training"))
from common import schedule_steps, training_steps  # noqa: E402


def test_the_steps_shrink_to_what_the_rate_after_the_warm_up_fits():
    args = Namespace(minutes=1.0, steps=1000)
    # steps 10 -> 40 took 6 s (5 steps/s; the first 10 took 4 s of warm-up); 50 s are left
    assert schedule_steps(args, 40, 10.0, since=(10, 4.0))
    assert args.steps == 40 + 250


def test_a_budget_that_fits_the_schedule_or_no_budget_changes_nothing():
    roomy = Namespace(minutes=10.0, steps=1000)
    assert not schedule_steps(roomy, 40, 10.0, since=(10, 4.0)) and roomy.steps == 1000
    unset = Namespace(minutes=None, steps=1000)
    assert not schedule_steps(unset, 40, 1e6, since=(10, 4.0)) and unset.steps == 1000


def test_an_overrun_budget_still_takes_one_more_step():
    args = Namespace(minutes=0.1, steps=1000)  # 6 s, already spent
    assert schedule_steps(args, 40, 10.0, since=(10, 4.0)) and args.steps == 41


def test_the_loop_yields_every_step_once():
    args = Namespace(minutes=None, steps=45)
    assert [step for step, _ in training_steps(args, "test")] == list(range(45))
