"""bench/probe_decision.py: its rule (committed before any run) on hand-made finals, written here from its
wording, and a smoke run of every step on a tiny model (not the decision, and said so)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench import probe_decision as pd
from tests.tiny import tiny_model


def arm(primary: list[float], second: list[float]) -> pd.ArmFinals:
    return pd.ArmFinals(primary=dict(enumerate(primary)), second=dict(enumerate(second)))


LOW, HIGH = [1.00, 1.01, 1.02], [1.10, 1.12, 1.11]


@pytest.mark.parametrize(("jsigma", "probe", "verdict"), [
    (arm(HIGH, HIGH), arm(LOW, LOW), pd.PROBE_BETTER),  # every probe run below on both domains, 0.1 apart
    (arm(LOW, LOW), arm(HIGH, HIGH), pd.JSIGMA_BETTER),
    (arm(HIGH, HIGH), arm(LOW, [1.00, 1.01, 1.115]), pd.NOT_SHOWN),  # overlaps on the second domain only
    (arm([1.016, 1.02, 1.018], HIGH), arm([1.005, 1.01, 1.015], LOW), pd.NOT_SHOWN),  # separated, means 0.008 apart
    (arm(HIGH[:2], HIGH), arm(LOW, LOW), pd.NOT_DECIDED),  # two seeds
])
def test_the_rule(jsigma, probe, verdict):
    assert pd.probe_decision(same_layout=False, jsigma=jsigma, probe=probe)["verdict"] == verdict


def test_the_same_pick_is_not_trained_and_says_so():
    said = pd.probe_decision(same_layout=True, jsigma=None, probe=None)
    assert said["verdict"] == pd.SAME
    assert pd.probe_decision(same_layout=False, jsigma=None, probe=arm(LOW, LOW))["verdict"] == pd.NOT_DECIDED


def test_a_quick_run_on_a_tiny_model_probes_trains_and_is_not_the_decision(tmp_path, capsys):
    model_dir = tmp_path / "model"
    tiny_model("llama").save_pretrained(model_dir)
    for seed, name in enumerate(("calib", "train", "eval", "eval2")):
        np.save(tmp_path / f"{name}.npy", np.random.default_rng(seed).integers(0, 97, size=8 * 32))
    result = pd.main(["--quick", "--model", str(model_dir), "--devices", "2", "--calib", str(tmp_path / "calib.npy"),
                      "--train", str(tmp_path / "train.npy"), "--eval", str(tmp_path / "eval.npy"),
                      "--eval2", str(tmp_path / "eval2.npy"), "--work", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert pd.PROBE_RULE in out and "a smoke run, not the decision" in out and not result["decision"]
    probe = result["probe"]
    assert len(probe["candidates"]) == 2 and probe["chosen"] in probe["candidates"]
    if probe["same_layout"]:
        assert result["verdict"]["verdict"] == pd.SAME
    else:  # both arms trained with the quick preset's two seeds: too few for the rule
        assert result["verdict"]["verdict"] == pd.NOT_DECIDED
        assert len(result["final_kl"][pd.PROBE]) == 2 and len(result["final_kl_second_domain"][pd.JSIGMA]) == 2
    saved = json.loads((tmp_path / "work" / "probe-decision.json").read_text())
    assert saved["verdict"] == result["verdict"] and saved["rule"] == pd.PROBE_RULE


def test_the_default_command_is_the_decision_and_a_changed_flag_is_not():
    # the default model is the packaged GGUF, named by no flag (DECISION's model None); the experiment later
    # resolves it to a path, which must not make the committed setup a smoke run
    assert pd.is_decision(pd.parse_args([]))
    assert not pd.is_decision(pd.parse_args(["--steps", "50"]))
    assert not pd.is_decision(pd.parse_args(["--quick"]))

