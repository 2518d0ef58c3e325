"""Evaluation problems appear in no corpus a bundled checkpoint saw (issue 11, item 16): the
exclusion reads every checkpoint's ``training.json``, the drafter's corpus (seed 101) included."""

import json

from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.evaluate.runner import EVAL_SEED, held_out, training_questions
from tensorrt_llm.evaluate.tasks import gsm8k_tiny, multiturn_copy


def test_the_drafters_record_names_the_corpus_it_trained_on():
    record = json.loads((BUNDLED_DRAFT / "training.json").read_text())
    assert record["corpus_seed"] == record["seed"] + 100 == 101  # train_eagle3.py's offset


def test_no_evaluation_problem_is_in_the_target_or_drafter_corpus():
    target, drafter = training_questions(BUNDLED_TARGET), training_questions(BUNDLED_DRAFT)
    exclude = training_questions(BUNDLED_TARGET, BUNDLED_DRAFT)
    assert exclude == target | drafter and drafter - target  # the drafter's corpus adds questions
    for generator, seed, count in (
        (gsm8k_tiny, EVAL_SEED, 200),
        (multiturn_copy, EVAL_SEED + 2, 32),
    ):
        problems = held_out(generator, count, seed, exclude)
        firsts = [(p[0] if isinstance(p, tuple) else p)[0]["content"] for p in problems]
        assert not set(firsts) & (target | drafter)
