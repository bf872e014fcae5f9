"""The config dataclasses' shared field checks (hap/config.py): every config names the field,
what it must be and what it got, in one line, for a wrong type as for a wrong value."""

import math

import pytest

from hap.automap.dqn import DQNConfig
from hap.config import flag, number, one_of, whole
from hap.pipeline.rebalance import RebalanceConfig
from hap.planner import PlannerConfig
from hap.straggler import StragglerConfig
from hap.sync import AutoSyncConfig, SpaceConfig


def test_rules_hold_exactly_on_their_bounds():
    at_least_1 = whole(1)
    assert at_least_1(1) is None and at_least_1(7) is None
    for bad in (0, -1, 2.0, True, "3", None):  # True is an int to Python, not a count
        assert at_least_1(bad) == "a whole number of at least 1"
    assert whole(1, none="no limit")(None) is None
    assert whole(0, note="0: the planner's choice")(-1) == "a whole number of at least 0 (0: the planner's choice)"
    closed, open_ = number(0, 1), number(0, 1, above=True, below=True)
    assert closed(0) is None and closed(1) is None and closed(0.5) is None
    assert open_(0) == open_(1) == "a number in (0, 1)" and open_(0.5) is None
    for bad in (math.nan, math.inf, -math.inf, False, "0.5"):
        assert closed(bad) == "a number in [0, 1]"
    assert number(0, above=True)(0.0) == "a number above 0" and number(0)(0.0) is None
    assert number(high=1)(2) == "a number of at most 1" and number(high=1, below=True)(1) == "a number below 1"
    assert one_of("gpipe", "1f1b")("GPipe") == "one of gpipe, 1f1b"
    assert flag()("no") == "true or false" and flag()(False) is None


@pytest.mark.parametrize("make, message", [
    (lambda: PlannerConfig(micro_batches=-2),
     "PlannerConfig.micro_batches must be a whole number of at least 0 (0: the planner's choice), got -2"),
    (lambda: PlannerConfig(schedule="zb"), "PlannerConfig.schedule must be one of gpipe, 1f1b or None (1f1b), got 'zb'"),
    (lambda: DQNConfig(depth=-1), "DQNConfig.depth must be a whole number of at least 0, got -1"),
    # a string compared with a number: a TypeError deep in the loop's first round, before
    (lambda: AutoSyncConfig(trials="5"), "AutoSyncConfig.trials must be a whole number of at least 0, got '5'"),
    (lambda: AutoSyncConfig(local=math.nan), "AutoSyncConfig.local must be a number in [0, 1], got nan"),
    # refused by scikit-learn after 20 s of measuring, not naming --seed
    (lambda: AutoSyncConfig(seed=-5), "AutoSyncConfig.seed must be a whole number of at least 0 and at most 4294967295, "
                                      "got -5"),
    (lambda: SpaceConfig(low_rank=True), "SpaceConfig.low_rank must be a whole number of at least 1, got True"),
    (lambda: AutoSyncConfig(baselines="no"), "AutoSyncConfig.baselines must be true or false, got 'no'"),  # it was true
    # the straggler configs named no field ("need 0 < cap < 1, threshold > 0, ...") and left
    # the PriDiff knobs unchecked
    (lambda: StragglerConfig(cap=1.0), "StragglerConfig.cap must be a number in (0, 1), got 1.0"),
    (lambda: StragglerConfig(alpha=1.5), "StragglerConfig.alpha must be a number in [0, 1], got 1.5"),
    (lambda: StragglerConfig(policy="zero"),
     "StragglerConfig.policy must be one of none, zero-rd, zero-pri, zero-pridiff-e, zero-pridiff-r, migrate, semi, "
     "rebalance, got 'zero'"),
    (lambda: StragglerConfig(policy="semi", handover=(0.5, 0.0)),
     "StragglerConfig.handover is for policy 'migrate', one share in [0, 1] per rank, got (0.5, 0.0) with policy 'semi'"),
    (lambda: RebalanceConfig(threshold=0), "RebalanceConfig.threshold must be a number above 0, got 0"),
])
def test_each_config_names_the_field_in_one_line(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == message


def test_defaults_pass():
    for config in (PlannerConfig, DQNConfig, AutoSyncConfig, SpaceConfig, StragglerConfig, RebalanceConfig):
        config()
