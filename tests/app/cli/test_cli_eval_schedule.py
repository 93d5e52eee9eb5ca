"""`dtp-layout eval --schedule S` (issue 20) end to end on a tiny random checkpoint saved to disk."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.cli.main import main
from tests.tiny import tiny_model

LAYERS = 3  # tests.tiny's num_hidden_layers
MODULES = 2 * LAYERS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("qwen3").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "ids.npy"
    np.save(path, np.random.default_rng(0).integers(0, 97, size=4 * 16))
    return path


def _eval(checkpoint, data, capsys, *argv: str) -> dict:
    code = main(["eval", str(checkpoint), "--devices", "2", "--data", str(data), "--blocks", "4",
                 "--seq-len", "16", "--json", "--device", "cpu", *argv])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])


def test_tp_is_the_dense_model_under_any_layout(checkpoint, data, capsys):
    contiguous = _eval(checkpoint, data, capsys, "--schedule", "tp")
    shuffled = _eval(checkpoint, data, capsys, "--schedule", "tp", "--layout", "random:3")
    for result in (contiguous, shuffled):
        assert result["schedule"] == "tp" and result["layout_independent"] is True
        assert result["syncs_per_token"] == MODULES
        assert result["kl"] == pytest.approx(0.0, abs=1e-6)
        assert result["dtp_ppl"] == pytest.approx(result["dense_ppl"], rel=1e-5)
    assert shuffled["layout"] == "random-3"
    assert shuffled["kl"] == pytest.approx(contiguous["kl"], abs=1e-6)


def test_ladder_does_not_depend_on_the_layout(checkpoint, data, capsys):
    contiguous = _eval(checkpoint, data, capsys, "--schedule", "ladder")
    shuffled = _eval(checkpoint, data, capsys, "--schedule", "ladder", "--layout", "random:3")
    dtp = _eval(checkpoint, data, capsys, "--layout", "random:3")  # the same layout at dtp:1 does depend on it
    dtp_contiguous = _eval(checkpoint, data, capsys)
    assert contiguous["schedule"] == shuffled["schedule"] == "ladder"
    assert contiguous["layout_independent"] is True and contiguous["syncs_per_token"] == MODULES - 1
    assert contiguous["kl"] > 1e-4  # every output one module late is not the dense model
    assert shuffled["kl"] == pytest.approx(contiguous["kl"], rel=1e-5)
    assert abs(dtp["kl"] - dtp_contiguous["kl"]) > 1e-3 * dtp_contiguous["kl"]  # the control: layouts differ there


def test_dtp1_is_the_default(checkpoint, data, capsys):
    default = _eval(checkpoint, data, capsys, "--layout", "random:3")
    explicit = _eval(checkpoint, data, capsys, "--layout", "random:3", "--schedule", "dtp:1")
    both = _eval(checkpoint, data, capsys, "--layout", "random:3", "--schedule", "dtp:1", "--delta", "1")
    assert default == explicit == both  # bit for bit: same KL, perplexities, and record
    assert default["schedule"] == "dtp:1" and default["delta"] == 1 and default["layout_independent"] is False
    assert default["syncs_per_token"] == MODULES - 1


def test_a_dtp_schedule_gives_the_layouts_delta(checkpoint, data, capsys):
    by_schedule = _eval(checkpoint, data, capsys, "--schedule", "dtp:2")
    by_delta = _eval(checkpoint, data, capsys, "--delta", "2")
    assert by_schedule == by_delta and by_schedule["delta"] == 2 and by_schedule["syncs_per_token"] == MODULES - 2
    partial = _eval(checkpoint, data, capsys, "--schedule", "dtp:1@2")
    assert partial["schedule"] == "dtp:1@2" and partial["delta"] == 1
    assert 0 < partial["kl"] != pytest.approx(by_schedule["kl"])
    pt = _eval(checkpoint, data, capsys, "--schedule", "pt:2")
    assert pt["schedule"] == "pt:2" and pt["syncs_per_token"] == 2 and pt["layout_independent"] is False
    assert pt["delta"] == 1  # the layout's δ, the flag's default: recorded, not simulated


def test_text_output_names_the_schedule_and_says_when_the_layout_does_not_matter(checkpoint, data, capsys):
    argv = ["eval", str(checkpoint), "--devices", "2", "--data", str(data), "--blocks", "2", "--seq-len", "16",
            "--device", "cpu", "--layout", "random:3"]
    assert main([*argv, "--schedule", "ladder"]) == 0
    out = capsys.readouterr().out
    assert f"schedule ladder  {MODULES - 1} syncs per token" in out
    assert "the layout does not change the result" in out
    assert main([*argv, "--schedule", "spd:0,2"]) == 0
    out = capsys.readouterr().out
    assert f"schedule spd:0,2  {MODULES - 2} syncs per token" in out
    assert "does not change" not in out


@pytest.mark.parametrize(
    ("argv", "messages", "before_loading"),
    [
        (["--schedule", "bogus"], ["unknown schedule 'bogus'", "accepted: tp, dtp:δ"], True),
        (["--schedule", "dtp:x"], ["δ must be an integer", "accepted:"], True),
        (["--schedule", "spd:auto:2"], ["sensitivity pass", "only `optimise` and a job", "spd:B"], True),
        (["--delta", "2", "--schedule", "dtp:1"], ["--delta 2", "--schedule dtp:1", "disagree"], True),
        (["--delta", "0", "--schedule", "dtp:1@2"], ["--delta 0", "--schedule dtp:1@2"], True),
        (["--schedule", "spd:7"], ["layers [7] do not exist"], False),
        (["--schedule", "pt:9"], ["D=9", "1 .. 3"], False),
    ],
)
def test_schedule_user_errors(checkpoint, data, capsys, argv, messages, before_loading):
    code = main(["eval", str(checkpoint), "--devices", "2", "--data", str(data), "--blocks", "2",
                 "--seq-len", "16", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2
    for message in messages:
        assert message in err
    assert ("loading " not in err) == before_loading  # a malformed schedule fails before the weights load
