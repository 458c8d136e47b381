"""FitToMemory's decisions as pure functions: evidence and settings in, a decision out (no engine, no meter)."""

import json
import math

import pytest

from toma import FitToMemory
from toma.core.caches import Batchsize
from toma.sizing.bracket import Evidence
from toma.sizing.decision import Choice, Decision, Findings, after_failure, after_fit, at_start, choose
from toma.sizing.learned import Learned, Origin
from toma.sizing.need import Need
from toma.sizing.settings import FitSettings
from toma.sizing.trust import Trust, Verdict, judge_failure, judge_fit

GiB = 2**30
SETTINGS = FitSettings()
LINE = Need(64 * 2**20, 10 * 2**10)  # 64 MiB + 10 KiB per row: M = 98304 rows under 1 GiB


def measured_on(need, *sizes):
    return tuple((float(s), need.need(s)) for s in sizes)


def evidence(start=None, fits=(), failures=(), budget=GiB):
    """Evidence of fits (items) and failures ((items, bound) or items) under one budget."""
    known = Evidence(start=start)
    for items in fits:
        known.fitted(float(items), budget)
    for failure in failures:
        items, bound = failure if isinstance(failure, tuple) else (failure, 0.0)
        known.failed(float(items), bound, budget)
    return known


def test_an_error_nothing_explains_halves():
    choice = choose(Findings(evidence(start=4096, failures=[4096])), GiB, 1.0, SETTINGS)
    assert choice == Choice(2048.0, "halving: nothing measured explains the error; bracket fit -, failed 4096")


def test_errors_alone_aim_at_a_quarter_of_the_budget_by_their_floor():
    findings = Findings(evidence(start=1 << 20, failures=[(1 << 20, 8.0 * GiB)]))
    choice = choose(findings, GiB, 1.0, SETTINGS)
    floor = findings.model()
    assert floor is not None and floor.per_item == 8.0 * GiB / (1 << 20)
    assert choice.items == floor.largest_within(GiB / 4) and choice.rule.startswith("a quarter of the budget")
    assert choose(findings, GiB, 1.0, FitSettings(errors_share=0.5)).items == floor.largest_within(GiB / 2)


def test_a_model_that_has_been_right_proposes_the_share_of_m_it_predicts():
    findings = Findings(evidence(start=1 << 20, fits=[20000, 40000]), measured_on(LINE, 20000, 40000))
    best = LINE.largest_within(GiB)
    for margin in (0.05, 0.1):
        choice = choose(findings, GiB, 1.0, FitSettings(margin=margin))
        assert choice.items == pytest.approx((1 - margin) * best) and not choice.probe, choice
    # a narrow margin far above every measured size lands with the wider margin first
    narrow = choose(findings, GiB, 1.0, FitSettings(margin=0.02))
    assert narrow.items == pytest.approx(0.95 * best) and "5% to spare first" in narrow.rule


def test_one_size_measured_is_probed_once_at_a_smaller_size():
    line = Need(0.0, 10 * 2**10)
    size = 0.95 * line.largest_within(GiB)
    findings = Findings(evidence(start=1 << 20, fits=[size]), measured_on(line, size))
    choice = choose(findings, GiB, 1.0, SETTINGS)
    assert choice.probe and choice.items == pytest.approx(0.8 * size) and "to learn how the need grows" in choice.rule
    again = choose(Findings(findings.evidence, findings.measured, Trust(probed=True)), GiB, 1.0, SETTINGS)
    assert not again.probe and again.items > size * 0.9


def test_one_size_measured_at_one_row_is_probed_at_two_rows_where_no_fewer_is_left():
    # 300 MiB measured at one row reads as 300 MiB per row (the fixed part unknown), bent up by the failure so
    # that 2 rows fit and 3 do not: the proposal, (1 - margin) of 2, runs that one row again, and the probe of a
    # smaller size has no fewer rows to run, so it measures one row more
    bound = 300.0 * 2**20 * 976 + 50.0 * 2**20 * 976 * 975
    findings = Findings(evidence(start=976, fits=[1], failures=[(976, bound)]), ((1.0, 300.0 * 2**20),))
    choice = choose(findings, 1000 * 2**20, 1.0, SETTINGS)
    assert choice.probe and choice.items == 2.0 and "to learn how the need grows" in choice.rule, choice
    again = choose(Findings(findings.evidence, findings.measured, Trust(probed=True)), 1000 * 2**20, 1.0, SETTINGS)
    assert not again.probe


def test_a_bend_from_an_error_far_above_does_not_hold_the_size_at_the_largest_measured_one():
    # 5 MiB + 64 B * size**3, measured at 7, 8 and 9 rows (the line says tens of thousands fit), and failures
    # far above: a bend steep enough to say 10 rows would not fit would hold the size where it is forever; the
    # bracket measures between them instead (a size halving's search reaches too)
    def cube(size):
        return 5.0 * 2**20 + 64.0 * size**3

    budget = 1000.0 * 2**20
    failures = [(10**7, cube(10**7)), (9765, cube(9765) * 10**5)]
    findings = Findings(
        evidence(start=10**7, fits=[7, 8, 9], failures=failures, budget=budget),
        tuple((float(s), cube(s)) for s in (9, 7, 8)),
        Trust(probed=True),
    )
    choice = choose(findings, budget, 1.0, SETTINGS)
    assert 9 * SETTINGS.far < choice.items < 9765 and "only the bend" in choice.rule, choice
    # a bend that only trims what the measured line allows keeps the model's proposal
    line = Need(5.0 * 2**20, 2**20)
    near = Findings(
        evidence(start=4000, fits=[900], failures=[(4000, line.need(4000) * 4)], budget=budget),
        ((900.0, line.need(900)), (500.0, line.need(500))),
        Trust(probed=True),
    )
    assert "only the bend" not in choose(near, budget, 1.0, SETTINGS).rule


def test_the_bracket_disposes_a_failure_caps_the_model_and_halving_bounds_the_search():
    # the line says 98304 rows fit, but 60000 failed under this budget, needing at least 1.1 GiB: the model bends
    # above 40000 to explain it, and nothing at or above 60000 is tried again
    failure = (60000, 1.1 * GiB)
    findings = Findings(evidence(start=60000, fits=[20000, 40000], failures=[failure]), measured_on(LINE, 20000, 40000))
    wrong = Findings(findings.evidence, findings.measured, Trust(Verdict.MISPREDICTED, 60000.0))
    for known in (findings, wrong):
        choice = choose(known, GiB, 1.0, SETTINGS)
        assert 40000 <= choice.items < 60000 and choice.rule.endswith("bracket fit 40000, failed 60000"), choice
    assert "was wrong at 60000" in choose(wrong, GiB, 1.0, SETTINGS).rule
    unexplained = Findings(evidence(start=60000, fits=[20000, 40000], failures=[60000]), findings.measured)
    assert choose(unexplained, GiB, 1.0, SETTINGS).rule.startswith("bisection: the model cannot explain an error")


def test_a_model_that_overestimates_leaves_the_size_to_bisection():
    known = evidence(start=1 << 17, fits=[20000], failures=[(80000, 1.1 * GiB)])
    choice = choose(Findings(known, measured_on(LINE, 10000, 20000), Trust(Verdict.OVERESTIMATED)), GiB, 1.0, SETTINGS)
    # between the largest fit and halving's 65536 (below the failure): the middle
    assert choice.items == (20000 + 65536) / 2 and choice.rule.startswith("bisection: model"), choice


def test_choosing_reads_the_evidence_and_changes_none_of_it():
    known = evidence(start=4096, fits=[512], failures=[(2048, 2.0 * 2**20), 4096])
    before = json.dumps(known.to_dict())
    findings = Findings(known, ((512.0, 512 * 2**10),), Trust(Verdict.MISPREDICTED, 2048.0))
    first = choose(findings, GiB, 1.0, SETTINGS)
    assert json.dumps(known.to_dict()) == before and choose(findings, GiB, 1.0, SETTINGS) == first


def test_rows_hold_scale_items_each():
    findings = Findings(evidence(start=4096, failures=[4096 * 9]))
    assert choose(findings, GiB, 9.0, SETTINGS).items == 2048 * 9
    assert after_failure(findings, 4096, 0.0, GiB, 9.0, SETTINGS).size == 2048
    assert FitSettings(minimum=4).rows(3.0, 1.0) == 4 and SETTINGS.rows(17.999999999, 9.0) == 2


def test_a_call_keeps_the_remembered_size_under_about_the_budget_it_was_found_with():
    findings = Findings(evidence(fits=[20000, 40000]), measured_on(LINE, 20000, 40000))
    assert at_start(findings, GiB, 1.01 * GiB, 1.0, 10**6, SETTINGS) == Decision(None)
    assert at_start(findings, GiB, 0.98 * GiB, 1.0, 10**6, SETTINGS) == Decision(None)
    less = at_start(findings, GiB, 0.5 * GiB, 1.0, 10**6, SETTINGS)
    assert less.size == math.floor(0.95 * LINE.largest_within(0.5 * GiB))
    assert less.why.startswith("predicted for 512.0 MiB free")
    assert at_start(findings, None, GiB, 1.0, 1000, SETTINGS).size == 1000, "never above the size asked for"


def test_after_a_fit_a_change_within_the_noise_keeps_the_size():
    findings = Findings(evidence(start=1 << 20, fits=[20000, 40000]), measured_on(LINE, 20000, 40000))
    best = math.floor(0.95 * LINE.largest_within(GiB))
    assert after_fit(findings, best + 100, GiB, 1.0, SETTINGS).size is None
    grown = after_fit(findings, 40000, GiB, 1.0, SETTINGS)
    assert grown.size == best and grown.why.startswith("model")


def test_after_a_failure_the_size_is_below_it_or_none_is_left():
    findings = Findings(evidence(start=64, failures=[64]))
    assert after_failure(findings, 64, 0.0, GiB, 1.0, SETTINGS).size == 32
    at_minimum = after_failure(Findings(evidence(start=4, failures=[4])), 4, 0.0, GiB, 1.0, FitSettings(minimum=4))
    assert at_minimum.size is None and at_minimum.why.startswith("needed >= 0 B of 1.0 GiB")


def test_the_settled_size_is_measured_half_as_often_each_time_to_a_floor():
    settings = FitSettings(measure_every=8, rarely=4)
    assert [settings.slower(every) for every in (0, 8, 16, 32)] == [16, 16, 32, 32]


def test_the_trust_follows_what_each_measured_attempt_says_of_the_model():
    measured = measured_on(LINE, 20000, 40000)
    assert judge_fit(Trust(), None, (), 1000.0, 1.0, SETTINGS) == Trust()
    assert judge_fit(Trust(), LINE, measured, 30000.0, 0.4 * LINE.need(30000), SETTINGS) == Trust(
        Verdict.OVERESTIMATED, 30000.0
    )
    above = judge_fit(Trust(), LINE, measured, 50000.0, 1.3 * LINE.need(50000), SETTINGS)
    assert above == Trust(Verdict.AGREED, 50000.0), "far more than predicted above every measured size"
    right = judge_fit(Trust(Verdict.MISPREDICTED, 50000.0, True), LINE, measured, 60000.0, LINE.need(60000), SETTINGS)
    assert right == Trust(Verdict.AGREED, 0.0, True), "right where it had to extrapolate: trusted again"
    failed = judge_failure(Trust(doubted=100.0), LINE, 50000.0, GiB)
    assert failed == Trust(Verdict.MISPREDICTED, 50000.0)
    assert judge_failure(failed, LINE, 200000.0, GiB) == Trust(Verdict.AGREED, 50000.0), "an error it predicted"


def test_a_size_file_line_written_before_the_decisions_were_pure_functions_still_restores():
    """A `describe()` text of toma before this refactor (a bent line, a failure, three fits): read back, the
    call under the same budget keeps the size; the same text comes back out, less halving's start."""
    text = (
        '{"fixed": 0.0, "per_item": 62756.0, "per_square": 0.0, "bend": 4.000000004659809, "knee": 15625.0, '
        '"per_power": 0.0, "power": 0.0, "budget": 1073741824, "scale": 1.0, "measured": [[976.0, 4060160.0], '
        '[15625.0, 980562500.0]], "start": 1000000, "fits": [[976.0, 1073741824], [15625.0, 1073741824], '
        '[15625.0, 1073741824]], "failures": [[1000000.0, 4000256004587.0, 1073741824, false]]}'
    )
    entry = Batchsize(15625)
    FitToMemory().restore(entry, text)
    state = entry.learned
    assert isinstance(state, Learned) and state.origin is Origin.RECALLED and state.budget == GiB
    assert state.measured == [(976.0, 4060160.0), (15625.0, 980562500.0)]
    assert state.evidence.bracket(GiB, 1.0).low == 15625 and state.evidence.bracket(GiB, 1.0).high == 1000000
    assert json.loads(state.describe() or "") == dict(json.loads(text), start=None)
    findings = state.findings()
    assert at_start(findings, state.budget, GiB, 1.0, 10**6, SETTINGS) == Decision(None)
    smaller = at_start(findings, state.budget, 600 * 2**20, 1.0, 10**6, SETTINGS)
    assert smaller.size == 9523, smaller  # what toma chose from this text before the refactor


def test_a_fork_for_a_new_free_memory_level_keeps_the_doubt_and_predicts_its_first_size():
    state = Learned(measured=[(1.0, 2.0)], trust=Trust(Verdict.MISPREDICTED, 7.0, True), scale=3.0, budget=5.0)
    fork = state.fork()
    assert fork.origin is Origin.FORKED and fork.trust == Trust(doubted=7.0) and fork.measured == state.measured
    assert (fork.scale, fork.budget) == (3.0, 5.0) and fork.measured is not state.measured
