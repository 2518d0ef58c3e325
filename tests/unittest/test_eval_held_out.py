"""The evaluation problems are in no bundled corpus: each checkpoint's ``training.json`` (the
target's MTP module's ``training_mtp.json``) records its corpus (seed, size) and what it holds out, truthfully, and rebuilding the corpus from
that record finds none of the problems the AL table and the tests evaluate."""

import json
import sys
from pathlib import Path

import pytest

from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.evaluate.tasks import (
    EVAL_STREAMS,
    MAX_EVAL_PROBLEMS,
    TRAINING_MIX,
    evaluation_problems,
    evaluation_questions,
    first_user_turn,
    held_out_record,
    training_conversations,
)


def record(model_dir, name: str = "training.json"):
    return json.loads((model_dir / name).read_text())


def test_each_record_names_the_seed_its_script_used():
    target, drafter = record(BUNDLED_TARGET), record(BUNDLED_DRAFT)
    assert target["script"].endswith("train_target.py") and target["corpus_seed"] == target["seed"]
    assert drafter["script"].endswith("train_eagle3.py")
    assert drafter["corpus_seed"] == drafter["seed"] + 100  # train_eagle3.py's corpus offset
    mtp = record(BUNDLED_TARGET, "training_mtp.json")  # the target's MTP module
    assert mtp["script"].endswith("train_mtp.py") and mtp["corpus_seed"] == mtp["seed"] + 200


def stages(rec: dict):
    """A record and those of the checkpoints it was started from (``init_from``), newest first."""
    while rec is not None:
        yield rec
        rec = (rec.get("init_from") or {}).get("training")


def rebuilt(rec: dict) -> tuple[set[str], int]:
    """The first user turns of the corpus a record names, and how many it skipped."""
    if rec.get("chat_format") == "m3":
        sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "training"))
        from m3_format import m3_conversations

        convs, skipped = m3_conversations(
            rec["corpus_seed"], rec["conversations"], evaluation_questions(), rec["long_min_chars"]
        )
        return {c.messages[0]["content"] for c in convs}, skipped
    mix = tuple(rec["mix"].values()) if "mix" in rec else TRAINING_MIX  # the first predates it
    convs, skipped = training_conversations(
        rec["corpus_seed"], rec["conversations"], rec["long_min_chars"], evaluation_questions(), mix
    )
    return {c[0]["content"] for c in convs}, skipped


@pytest.mark.parametrize(
    "model_dir, name",
    [
        (BUNDLED_TARGET, "training.json"),
        (BUNDLED_DRAFT, "training.json"),
        (BUNDLED_TARGET, "training_mtp.json"),
    ],
    ids=["target", "drafter", "mtp"],
)
def test_the_corpora_rebuilt_from_the_records_hold_no_evaluation_problem(model_dir, name):
    for rec in stages(record(model_dir, name)):
        held = rec["held_out"]
        assert {k: v for k, v in held.items() if k != "conversations_skipped"} == held_out_record()
        firsts, skipped = rebuilt(rec)
        assert skipped == held["conversations_skipped"] > 0  # the record is the corpus trained on
        for task in EVAL_STREAMS:
            problems = evaluation_problems(task, MAX_EVAL_PROBLEMS)
            assert not {first_user_turn(p) for p in problems} & firsts, task


def test_without_the_exclusion_the_corpora_would_hold_evaluation_problems():
    """The check above can fail: the unfiltered drafter corpus meets the evaluation streams."""
    rec = record(BUNDLED_DRAFT)
    convs, _ = training_conversations(rec["corpus_seed"], rec["conversations"])
    questions = {first_user_turn(p) for p in evaluation_problems("gsm8k-tiny", 200)}
    assert questions & {c[0]["content"] for c in convs}


def test_a_mix_that_is_not_three_shares_summing_to_one_is_refused():
    with pytest.raises(ValueError, match="mix=.*summing to 1"):
        training_conversations(0, 10, mix=(0.5, 0.3, 0.3))


def test_evaluations_beyond_the_held_out_problems_are_refused():
    with pytest.raises(ValueError, match="held out from the first 1000 only"):
        evaluation_problems("gsm8k-tiny", MAX_EVAL_PROBLEMS + 1)


def test_a_checkpoint_trained_without_the_exclusion_is_warned_about(tmp_path, caplog):
    import logging

    from tensorrt_llm.evaluate.runner import warn_unless_held_out

    caplog.set_level(logging.WARNING, logger="tensorrt_llm")
    (tmp_path / "training.json").write_text(json.dumps({"seed": 0, "conversations": 10}))
    warn_unless_held_out(BUNDLED_TARGET, BUNDLED_DRAFT, tmp_path, None)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0]
