"""A verdict must not depend on the bootstrap's random stream (issue 58 item 6).

Each end of a claim's interval carries its Monte Carlo range (the replicates' order statistics that hold
the infinite-replicate end with 95% probability); the stream goes on with more replicates until each end's
error is at most a tenth of its distance to the threshold, and a threshold still within an end's range makes
the verdict "borderline". Checked on a constructed case near the threshold and on every committed report.
"""

import math
import re
from pathlib import Path

import numpy as np
import pytest

from jaxreplay.research import report, report_regime
from jaxreplay.research.report_claims import Claim, verdict
from jaxreplay.research.report_data import group_settings, load_runs
from jaxreplay.research.report_stats import BOOTSTRAP_REPS, MAX_REPS, bootstrap_ci, bootstrap_interval
from report_tables import markdown_tables

ROOT = Path(__file__).resolve().parents[1]
# 24 paired differences, all distinct: the bootstrap's IQMs take so many values that the stream moves each end.
VALUES = list(np.random.default_rng(7).normal(0.01, 0.012, 24))


def _claim(threshold: float, above: bool = True) -> Claim:
    return Claim(name="c", text="c", settings=("a",), measure="peak", threshold=threshold, above=above)


def _far_lower_end() -> float:
    """The interval's lower end with the most replicates, where the stream barely moves it."""
    return bootstrap_interval([VALUES], reps=MAX_REPS).lo


def test_each_end_carries_a_range_that_holds_the_end_of_infinitely_many_replicates():
    ci = bootstrap_interval([VALUES])
    assert (ci.lo, ci.hi) == bootstrap_ci([VALUES]) and ci.reps == BOOTSTRAP_REPS  # the 10,000 of before
    assert ci.lo_range[0] < ci.lo < ci.lo_range[1] and ci.lo_error == max(ci.lo - ci.lo_range[0],
                                                                          ci.lo_range[1] - ci.lo)
    reference = bootstrap_interval([VALUES], reps=MAX_REPS, seed=99)  # the ends, moved 1/8 as far by its stream
    streams = [bootstrap_interval([VALUES], seed=s) for s in range(40)]
    assert len({c.lo for c in streams}) > 30  # the stream matters ...
    for end, bracket in ((reference.lo, "lo_range"), (reference.hi, "hi_range")):  # ... about 95% hold it: 39, 38
        assert sum(getattr(c, bracket)[0] <= end <= getattr(c, bracket)[1] for c in streams) >= 35
    assert ci.lo_error < 0.1 * (ci.hi - ci.lo)


def test_a_threshold_far_from_both_ends_keeps_the_10000_replicates_and_a_firm_verdict():
    ci = bootstrap_interval([VALUES], threshold=-0.02)
    assert ci.reps == BOOTSTRAP_REPS and ci.settled(-0.02)
    assert {verdict(_claim(-0.02), bootstrap_interval([VALUES], seed=s, threshold=-0.02)) for s in range(5)} == \
        {"holds"}


def test_a_threshold_near_an_end_draws_more_replicates_from_the_same_stream():
    lo = _far_lower_end()
    t = lo - 4 * bootstrap_interval([VALUES]).lo_error / 3  # outside the 10,000's error, but within ten of it
    ci = bootstrap_interval([VALUES], threshold=t)
    assert ci.reps > BOOTSTRAP_REPS and (ci.settled(t) or ci.reps == MAX_REPS)
    # the first 10,000 replicates are the same stream's: with them alone, the old interval
    assert bootstrap_interval([VALUES], threshold=t, max_reps=BOOTSTRAP_REPS).lo == bootstrap_ci([VALUES])[0]
    assert {verdict(_claim(t), bootstrap_interval([VALUES], seed=s, threshold=t)) for s in range(2)} == {"holds"}


def test_a_threshold_within_an_ends_monte_carlo_error_is_borderline_with_the_numbers():
    ci = bootstrap_interval([VALUES])
    t = (ci.lo + ci.lo_range[1]) / 2  # above the lower end, within its error: holds on some streams, not this one
    said = verdict(_claim(t), bootstrap_interval([VALUES], threshold=t))
    assert said.startswith("borderline: the interval's lower end, ") and "is within its Monte Carlo error (±" in said
    assert said.endswith(f"of the threshold {t:g}; another bootstrap stream can give holds or inconclusive")
    assert verdict(_claim(t), bootstrap_interval([VALUES], threshold=t, max_reps=BOOTSTRAP_REPS)).startswith(
        "borderline")  # without the further replicates as well
    # the other side: a "below" rule's lower end near its threshold can fail or be inconclusive
    below = verdict(_claim(t, above=False), bootstrap_interval([VALUES], threshold=t, max_reps=BOOTSTRAP_REPS))
    assert below.startswith("borderline") and below.endswith("can give inconclusive or fails")


def test_an_end_no_stream_moves_is_never_borderline():
    """Three values: the bootstrap's IQMs are a few atoms, and both ends sit on one whatever the stream."""
    ci = bootstrap_interval([[0.1, 0.05, -0.15]], threshold=-0.15)
    assert ci.lo == -0.15 and ci.lo_error == 0 and verdict(_claim(-0.15), ci) == "inconclusive"
    censored = bootstrap_interval([[math.inf] * 4], threshold=1.0)
    assert censored.lo == math.inf and censored.lo_error == 0 and verdict(_claim(1.0, above=False), censored) == "fails"


def _committed_claims(folder: Path):
    """(claims, settings, base, regime result, pools) as `jaxreplay report` builds them from a committed folder."""
    md = (folder / "report.md").read_text()
    command = re.search(r"`jaxreplay report runs/\*/\* --out \.([^`]*)`", md)
    dirs = sorted(p for p in (folder / "runs").glob("*/*") if p.is_dir())
    claims = report.load_claims(None, dirs)
    if command is None or not claims:
        return None
    baseline = re.search(r"--baseline (\S+)", command.group(1))
    settings = group_settings(load_runs(dirs))
    pools = report.split_pools(settings, baseline.group(1) if baseline else None)
    regime = report.load_regime(None, dirs)
    decided = None if regime is None else report_regime.decide(regime, settings)
    return claims, settings, pools[0][0], decided, {s.name: b for b, members in pools for s in members}


@pytest.mark.slow
def test_no_committed_verdict_changes_with_the_bootstrap_seed():
    """Every committed report's claims decided again under bootstrap seeds 0 (the report's) and 3: the same
    verdict, firm or borderline, and seed 0's is the committed one. (At a fixed 10,000 replicates, seed 3 read
    the pool study's pooled regime contrast "inconclusive" where seed 0 read "holds".)"""
    checked = 0
    for folder in sorted(p.parent for p in (ROOT / "results").glob("*/report.md")):
        built = _committed_claims(folder)
        if built is None:
            continue
        committed = markdown_tables((folder / "report.md").read_text())["Claims and verdicts"]
        by_seed = [{text: row["verdict"].split(":")[0] for text, row in
                    markdown_tables("## v\n" + report.claims_table(*built, bootstrap_seed=seed))["v"].items()}
                   for seed in (0, 3)]
        assert by_seed[0] == by_seed[1] == {t: row["verdict"].split(":")[0] for t, row in committed.items()}, folder
        checked += len(committed)
    assert checked >= 40  # the five committed reports with claims hold 47
