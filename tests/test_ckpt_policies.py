"""Save-decision and preservation policies (crucible.checkpoint.policies)."""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from crucible.checkpoint.policies import (
    AnyOf,
    BestN,
    CallablePolicy,
    CkptInfo,
    ContinuousPolicy,
    EveryNSeconds,
    EveryNSteps,
    FixedIntervalPolicy,
    KeepAll,
    LatestN,
    policy_from_config,
    save_policy_from_config,
    select_for_deletion,
)


def ck(step, time=None, **metrics):
    return CkptInfo(step=step, time=float(step if time is None else time), path=f"/c/step_{step:08d}", metrics=metrics)


def kept(policy, ckpts, now=1e9):
    return [c.step for c in ckpts if policy.should_preserve(c, ckpts, now)]


# ----------------------------------------------------------------- save


def test_policies_module_does_not_import_torch():
    code = "import sys, crucible.checkpoint.policies; print('torch' in sys.modules)"
    root = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env)
    assert out.stdout.strip() == "False"


def test_continuous_first_save_and_in_flight():
    p = ContinuousPolicy(minimum_interval_s=10)
    assert p.should_save(1, now=100.0, last_save_start=None, save_in_flight=False)
    # a save in flight always blocks the next one, however long ago it started
    assert not p.should_save(5, now=1000.0, last_save_start=100.0, save_in_flight=True)


def test_continuous_respects_minimum_interval():
    p = ContinuousPolicy(minimum_interval_s=10)
    assert not p.should_save(5, now=109.9, last_save_start=100.0, save_in_flight=False)
    assert p.should_save(5, now=110.0, last_save_start=100.0, save_in_flight=False)
    p0 = ContinuousPolicy(0)
    assert p0.should_save(2, now=100.0, last_save_start=100.0, save_in_flight=False)
    with pytest.raises(ValueError):
        ContinuousPolicy(-1)


def test_fixed_interval():
    p = FixedIntervalPolicy(100)
    got = [s for s in range(0, 401) if p.should_save(s, 0.0, None, False)]
    assert got == [100, 200, 300, 400]
    # never skipped because of a save in flight: the saver waits instead
    assert p.should_save(200, 0.0, 0.0, True)
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError):
            FixedIntervalPolicy(bad)


def test_next_save_preemption_composed_with_any_and_the_end():
    from crucible.checkpoint.policies import (AnySavePolicy, DecisionContext, EndOfJobPolicy,
                                              PreemptionCheckpointingPolicy)

    calm = DecisionContext(now=100.0, last_save_start=95.0)
    preempted = DecisionContext(now=100.0, last_save_start=95.0, reached_preemption=True)
    fixed, cont = FixedIntervalPolicy(25), ContinuousPolicy(10)
    assert [fixed.next_save(s, calm) for s in (1, 25, 26)] == [25, 25, 50]
    assert cont.next_save(7, calm) is None and cont.next_save(7, DecisionContext(now=105.0, last_save_start=95.0)) == 7
    assert cont.next_save(7, DecisionContext(now=200.0, last_save_start=95.0, save_in_flight=True)) is None
    pre = PreemptionCheckpointingPolicy()
    assert pre.next_save(7, calm) is None and pre.next_save(7, preempted) == 7
    # the configured policy, overridden by a preemption: at once, not at the next multiple
    assert AnySavePolicy(pre, fixed).next_save(26, calm) == 50
    assert AnySavePolicy(pre, fixed).next_save(26, preempted) == 26
    assert AnySavePolicy(pre, cont).next_save(7, calm) is None
    assert AnySavePolicy(pre, cont).next_save(7, preempted) == 7
    end = EndOfJobPolicy(300)
    assert end.next_save(299, calm) is None and end.next_save(300, calm) == 300 and end.next_save(340, calm) == 300
    assert end.next_save(10, DecisionContext(now=0.0, reached_end=True)) == 300
    assert EndOfJobPolicy(0).next_save(10, DecisionContext(now=0.0, reached_end=True)) is None
    with pytest.raises(ValueError):
        AnySavePolicy()


# ----------------------------------------------------------------- preserve


def test_latest_n():
    cs = [ck(s) for s in (10, 20, 30, 40, 50)]
    assert kept(LatestN(2), cs) == [40, 50]
    assert kept(LatestN(10), cs) == [10, 20, 30, 40, 50]
    with pytest.raises(ValueError):
        LatestN(0)


def test_every_n_steps():
    cs = [ck(s) for s in (500, 1000, 1500, 2000, 2001)]
    assert kept(EveryNSteps(1000), cs) == [1000, 2000]


def test_every_n_seconds_keeps_first_of_each_window():
    # windows of 100 s: [0,100) [100,200) [200,300)
    cs = [ck(1, 5), ck(2, 50), ck(3, 99.9), ck(4, 100), ck(5, 150), ck(6, 290)]
    assert kept(EveryNSeconds(100), cs) == [1, 4, 6]
    # stable: deleting what it does not keep does not change what it keeps
    rest = [c for c in cs if c.step in (1, 4, 6)]
    assert kept(EveryNSeconds(100), rest) == [1, 4, 6]


def test_best_n():
    cs = [ck(1, eval_loss=3.0), ck(2, eval_loss=2.0), ck(3), ck(4, eval_loss=2.5), ck(5, eval_loss=float("nan")), ck(6, eval_loss=2.0)]
    # ties go to the newer checkpoint; no metric / NaN is never kept by it
    assert kept(BestN(1), cs) == [6]
    assert kept(BestN(2), cs) == [2, 6]
    assert kept(BestN(10), cs) == [1, 2, 4, 6]
    assert kept(BestN(1, "eval_loss", mode="max"), cs) == [1]
    assert kept(BestN(1, metric="accuracy"), cs) == []
    with pytest.raises(ValueError):
        BestN(1, mode="median")


def test_any_of():
    cs = [ck(s) for s in (1000, 1100, 1200, 1300, 2000, 2100)]
    p = AnyOf(LatestN(1), EveryNSteps(1000))
    assert kept(p, cs) == [1000, 2000, 2100]
    with pytest.raises(ValueError):
        AnyOf()


def test_callable_policy(tmp_path, monkeypatch):
    (tmp_path / "my_retention.py").write_text(
        textwrap.dedent(
            """
            def odd_steps(ckpt, all, now):
                return ckpt.step % 2 == 1
            class Holder:
                @staticmethod
                def none(ckpt, all, now):
                    return False
            not_callable = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cs = [ck(s) for s in range(1, 6)]
    assert kept(CallablePolicy("my_retention:odd_steps"), cs) == [1, 3, 5]
    assert kept(CallablePolicy("my_retention:Holder.none"), cs) == []
    with pytest.raises(ValueError, match="cannot import module"):
        CallablePolicy("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no attribute"):
        CallablePolicy("my_retention:missing")
    with pytest.raises(ValueError, match="not callable"):
        CallablePolicy("my_retention:not_callable")
    with pytest.raises(ValueError, match="module:function"):
        CallablePolicy("my_retention.odd_steps")


# ----------------------------------------------------------------- deletion


def test_deletion_never_touches_the_newest():
    cs = [ck(s) for s in (1, 2, 3, 4)]

    class Nothing:
        def should_preserve(self, c, all, now):
            return False

    doomed = select_for_deletion(cs, Nothing(), now=0.0)
    assert [c.step for c in doomed] == [1, 2, 3]
    # unsorted input, a single checkpoint, none
    assert [c.step for c in select_for_deletion(cs[::-1], Nothing(), 0.0)] == [1, 2, 3]
    assert select_for_deletion([ck(7)], Nothing(), 0.0) == []
    assert select_for_deletion([], Nothing(), 0.0) == []
    assert select_for_deletion(cs, None, 0.0) == []


def test_deletion_newest_survives_even_when_bestn_disagrees():
    cs = [ck(1, eval_loss=1.0), ck(2, eval_loss=5.0), ck(3, eval_loss=9.0)]
    doomed = select_for_deletion(cs, BestN(1), now=0.0)
    assert [c.step for c in doomed] == [2]


def test_deletion_with_latest_n_and_every_n_steps():
    cs = [ck(s) for s in range(100, 2100, 100)]
    p = AnyOf(LatestN(3), EveryNSteps(1000))
    doomed = {c.step for c in select_for_deletion(cs, p, 0.0)}
    assert doomed == set(range(100, 1800, 100)) - {1000}
    remaining = [c for c in cs if c.step not in doomed]
    assert select_for_deletion(remaining, p, 0.0) == []  # converges


# ----------------------------------------------------------------- config


def test_policy_from_config():
    assert policy_from_config({}) == KeepAll()
    assert policy_from_config({"max_num_checkpoints_to_keep": None}) == KeepAll()
    assert policy_from_config({"max_num_checkpoints_to_keep": 10}) == LatestN(10)
    assert policy_from_config({"max_num_checkpoints_to_keep": "4"}) == LatestN(4)
    p = policy_from_config(
        {"max_num_checkpoints_to_keep": 5, "preserve": "latest_n:10, every_n_steps:1000,best_n:3,every_n_seconds:3600"}
    )
    assert p == AnyOf(LatestN(5), LatestN(10), EveryNSteps(1000), BestN(3, "eval_loss", "min"), EveryNSeconds(3600.0))
    p = policy_from_config({"preserve": "best_n:2:accuracy:max"})
    assert p == BestN(2, "accuracy", "max")


@pytest.mark.parametrize(
    "spec, bad",
    [
        ("latest_n:10,bogus:3", "bogus:3"),
        ("latest_n:x", "latest_n:x"),
        ("every_n_steps:0", "every_n_steps:0"),
        ("latest_n:1,best_n:2:eval_loss:sideways", "best_n:2:eval_loss:sideways"),
        ("every_n_seconds:-5", "every_n_seconds:-5"),
        ("latest_n", "latest_n"),
        ("callable:nope_mod_abc:f", "callable:nope_mod_abc:f"),
    ],
)
def test_policy_from_config_invalid_names_item(spec, bad):
    with pytest.raises(ValueError) as ei:
        policy_from_config({"preserve": spec})
    assert repr(bad) in str(ei.value)


def test_policy_from_config_invalid_count():
    for bad in (0, -1, "ten", True):
        with pytest.raises(ValueError, match="max_num_checkpoints_to_keep"):
            policy_from_config({"max_num_checkpoints_to_keep": bad})


def test_save_policy_from_config():
    assert save_policy_from_config({"enable_checkpointing": False}) is None
    assert save_policy_from_config(
        {"enable_continuous_checkpointing": True, "minimum_interval_s": "30", "checkpoint_period": 7}
    ) == ContinuousPolicy(30.0)
    assert save_policy_from_config({"checkpoint_period": 100}) == FixedIntervalPolicy(100)
    with pytest.raises(ValueError, match="checkpoint_period"):
        save_policy_from_config({"checkpoint_period": 0})
