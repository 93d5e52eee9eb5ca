"""Communication schedules (issue 20): the parser, the per-module tables, and the simulator against a
literal transcription of the schedule equation, for every preset, every family and L ∈ {2, 3, 4}.

The equation (before module t, per device l):

    X_l = X^(0) + Σ_{b_n ≤ t} s_n · o_n^l + Σ_{a_n ≤ t} Σ_{j≠l} o_n^j

output lm_head(mean_l final_norm(X_l)) with every arrival ≤ M included. The reference below rebuilds
every X_l from that sum at every t (nothing incremental), from tables transcribed here from the issue's
preset definitions (not from models.schedules.grammar), with the per-head / per-neuron partials of
test_dtp's reference on the unpermuted model.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from models.base.layout_format import LayoutError
from models.evaluation.evaluate import evaluate
from models.families import model_shape
from models.layouts.layout import Layout, contiguous, random
from models.schedules.grammar import (
    ACCEPTED,
    NEVER,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    check_schedule,
    parse_schedule,
    resolve_schedule,
)
from models.sim.dtp import DTPCache, DTPModel
from models.sim.partials import rms_norm
from models.sim.permute import permute_
from tests.models.test_dtp import ref_attention_partial, ref_ffn_partial, ref_rms_norm
from tests.tiny import FAMILY_CASES, fresh_for_devices, tokens

CASES = sorted(FAMILY_CASES)
DEVICES = [2, 3, 4]
LAYERS = 3  # the tiny models' depth: M = 6 modules
# Every preset on a 3-layer model, with the extremes of each parameter.
PRESETS = ["tp", "dtp:0", "dtp:1", "dtp:2", "dtp:3", "dtp:1@1", "dtp:1@2", "dtp:2@2", "ladder", "spd:1",
           "spd:0,2", "pt:1", "pt:2", "pt:3"]


# ---- the issue's presets, transcribed independently ----------------------------------------------

Tables = tuple[list[int], list[float], list[int | None]]  # b_n, s_n, a_n (None: ∞)


def literal_tables(text: str, M: int, L: int, last_scale: str = "sqrt") -> Tables:
    """The issue's bullet list, one preset at a time."""
    b: list[int] = [n + 1 for n in range(M)]
    s: list[float] = [1.0] * M
    a: list[int | None] = [n + 1 for n in range(M)]
    if text == "tp":
        pass
    elif text == "ladder":
        b = [min(n + 2, M) for n in range(M)]
        a = [min(n + 2, M) for n in range(M)]
    elif text.startswith("dtp:"):
        delta_text, _, k_text = text[4:].partition("@")
        delta = int(delta_text)
        K = int(k_text) if k_text else M // 2  # converted layers
        start = M - 2 * K  # modules below the converted part stay tp
        for n in range(start, M):
            k = n - start
            first, last = k < delta, k >= 2 * K - delta
            s[n] = math.sqrt(L) if first or (last and last_scale == "sqrt") else 1.0
            a[n] = n + delta + 1 if k <= 2 * K - 1 - delta else None
    elif text.startswith("spd:"):
        for i in map(int, text[4:].split(",")):
            a[2 * i] = 2 * i + 2
    elif text.startswith("pt:"):
        D = int(text[3:])
        a = [min(2 * D * (n // (2 * D) + 1), M) for n in range(M)]
    else:
        raise AssertionError(text)
    return b, s, a


# ---- the reference: the schedule equation, literally, per device, on the ORIGINAL model ------------

def ref_schedule_logits(model: PreTrainedModel, layout: Layout, ids: torch.Tensor, tables: Tables) -> torch.Tensor:
    b, s, a = tables
    L, M = layout.devices, len(b)
    emb = model.model.embed_tokens(ids)  # X^(0): [B, S, D]
    position_ids = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    cos, sin = model.model.rotary_emb(emb, position_ids)
    o: list[list[torch.Tensor]] = []  # o[n][l]

    def stream(l: int, t: int) -> torch.Tensor:
        """X_l before module t, from the sum (only computed modules can have arrived: b_n, a_n > n)."""
        X = emb.clone()
        for n in range(len(o)):
            if b[n] <= t:
                X = X + s[n] * o[n][l]
            if a[n] is not None and a[n] <= t:
                X = X + sum(o[n][j] for j in range(L) if j != l)
        return X

    for t in range(M):
        i = t // 2
        if t % 2 == 0:
            o.append([ref_attention_partial(model, layout, i, l, stream(l, t), cos, sin) for l in range(L)])
        else:
            o.append([ref_ffn_partial(model, layout, i, l, stream(l, t)) for l in range(L)])
    eps = model.config.rms_norm_eps
    final = sum(ref_rms_norm(stream(l, M), model.model.norm.weight, eps) for l in range(L)) / L
    return final @ model.lm_head.weight.T


def permuted(case: str, devices: int, seed: int) -> tuple[PreTrainedModel, PreTrainedModel, Layout]:
    """(original, permuted copy, the random layout between them)."""
    original = fresh_for_devices(case, devices)
    model = fresh_for_devices(case, devices)
    layout = random(model_shape(model.config), devices, 1, seed)
    permute_(model, layout)
    return original, model, layout


# ---- a. the parser and the tables ----------------------------------------------------------------

@pytest.mark.parametrize("text", [*PRESETS, "spd:auto:2", "dtp:12@40", "pt:7"])
def test_canonical_string_round_trips(text: str) -> None:
    spec = parse_schedule(text)
    assert str(spec) == text
    assert parse_schedule(str(spec)) == spec


def test_spd_layers_are_canonicalised() -> None:
    assert str(parse_schedule("spd:5,1,3")) == "spd:1,3,5"
    assert parse_schedule("spd:5,1,3") == parse_schedule("spd:1,3,5")


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("text", PRESETS)
def test_tables_are_the_issues(text: str, devices: int) -> None:
    M = 2 * LAYERS
    got = resolve_schedule(text, LAYERS, devices)
    b, s, a = literal_tables(text, M, devices)
    assert (list(got.own_arrival), list(got.own_scale), list(got.other_arrival)) == (b, s, a)
    assert got.num_modules == M and got.name == text


@pytest.mark.parametrize("text", ["dtp:1", "dtp:2", "dtp:2@2", "dtp:3"])
def test_last_scale_one_drops_the_last_roots(text: str) -> None:
    got = resolve_schedule(text, LAYERS, 4, "one")
    assert list(got.own_scale) == literal_tables(text, 2 * LAYERS, 4, "one")[1]
    assert got.own_scale != resolve_schedule(text, LAYERS, 4).own_scale


def test_full_conversion_is_dtp() -> None:
    for delta in range(LAYERS + 1):
        whole, converted = resolve_schedule(f"dtp:{delta}", LAYERS, 4), resolve_schedule(f"dtp:{delta}@{LAYERS}",
                                                                                          LAYERS, 4)
        assert (whole.own_arrival, whole.own_scale, whole.other_arrival) == (
            converted.own_arrival, converted.own_scale, converted.other_arrival)
    tp, dtp0 = resolve_schedule("tp", LAYERS, 4), resolve_schedule("dtp:0", LAYERS, 4)
    assert (tp.own_arrival, tp.own_scale, tp.other_arrival) == (dtp0.own_arrival, dtp0.own_scale, dtp0.other_arrival)


@pytest.mark.parametrize(("text", "syncs", "independent"), [
    # M = 6: tp M; dtp:δ and dtp:δ@K M-δ; ladder M-1 (the last two outputs share the point M); spd:B M-|B|;
    # pt:D ⌈layers/D⌉ (one exchange per block).
    ("tp", 6, True), ("dtp:0", 6, True), ("dtp:1", 5, False), ("dtp:3", 3, False), ("dtp:2@2", 4, False),
    ("ladder", 5, True), ("spd:1", 5, False), ("spd:0,2", 4, False), ("pt:1", 3, False), ("pt:2", 2, False),
    ("pt:3", 1, False),
])
def test_syncs_per_token_and_layout_independence(text: str, syncs: int, independent: bool) -> None:
    schedule = resolve_schedule(text, LAYERS, 4)
    assert schedule.syncs_per_token == syncs
    assert schedule.layout_independent is independent
    table = schedule.as_dict()
    assert table["schedule"] == text and table["syncs_per_token"] == syncs
    assert table["other_arrival"] == literal_tables(text, 6, 4)[2]


def test_real_model_sizes() -> None:
    """SmolLM2-135M's 30 layers: the study's rows."""
    layers = 30
    assert resolve_schedule("pt:4", layers, 3).syncs_per_token == 8  # ⌈30/4⌉
    assert resolve_schedule("dtp:1@15", layers, 3).syncs_per_token == 59
    upper_half = resolve_schedule("dtp:1@15", layers, 3)
    assert upper_half.own_scale[29] == 1.0 and upper_half.own_scale[30] == math.sqrt(3)
    assert upper_half.other_arrival[29] == 30 and upper_half.other_arrival[30] == 32
    assert upper_half.other_arrival[59] is NEVER


BAD = [
    ("", "unknown schedule ''"),
    ("DTP:1", "unknown schedule 'DTP'"),
    (" tp", "unknown schedule ' tp'"),
    ("tp:1", "tp takes no parameter, got '1'"),
    ("ladder:2", "ladder takes no parameter"),
    ("dtp", "dtp needs a parameter after ':'"),
    ("dtp:", "δ must be an integer ≥ 0, got ''"),
    ("dtp:x", "δ must be an integer ≥ 0, got 'x'"),
    ("dtp:-1", "δ must be an integer ≥ 0, got '-1'"),
    ("dtp:1.5", "got '1.5'"),
    ("dtp:1@0", r"K \(the converted upper layers\) must be an integer ≥ 1, got 0"),
    ("dtp:1@", "K .* got ''"),
    ("dtp:3@2", "δ=3 must be in 0 .. K=2"),
    ("spd:", "each layer of B must be an integer ≥ 0, got ''"),
    ("spd:1,,2", "each layer of B must be an integer ≥ 0, got ''"),
    ("spd:1, 2", "got ' 2'"),
    ("spd:1,1,3,3", r"layers \[1, 3\] are given more than once"),
    ("spd:auto", "expected spd:auto:K or spd:isolated:K, got spd:auto"),
    ("spd:autox:2", "expected spd:auto:K"),
    ("spd:auto:0", r"K \(layers to drop\) must be an integer ≥ 1, got 0"),
    ("pt", "pt needs a parameter"),
    ("pt:0", r"D \(layers per block\) must be an integer ≥ 1, got 0"),
    ("pt:1234567", "got '1234567'"),
    ("pt:2:3", "got '2:3'"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_strings_name_the_part_and_what_is_accepted(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        parse_schedule(text)
    assert f"schedule {text!r}" in str(info.value) and ACCEPTED in str(info.value)


@pytest.mark.parametrize("value", [None, 1, b"tp", ["tp"]])
def test_non_strings_are_refused(value: object) -> None:
    with pytest.raises(ScheduleError, match="schedule must be a string") as info:
        parse_schedule(value)  # type: ignore[arg-type]
    assert ACCEPTED in str(info.value)


def test_oversized_string_is_refused_unread() -> None:
    with pytest.raises(ScheduleError, match="at most 4096"):
        parse_schedule("spd:" + ",".join(map(str, range(2000))))


@pytest.mark.parametrize(("text", "message"), [
    ("dtp:4", "δ=4 must be in 0 .. num_layers=3"),
    ("dtp:1@4", "K=4 converted layers, but the model has num_layers=3"),
    ("spd:1,3,7", r"layers \[3, 7\] do not exist: the model's layers are 0 .. 2"),
    ("pt:4", "D=4 layers per block, but the model has num_layers=3"),
    ("spd:auto:2", "needs calibration data"),
])
def test_schedules_that_do_not_fit_the_model_are_refused(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        resolve_schedule(text, LAYERS, 2)
    with pytest.raises(ScheduleError, match=message):  # and by the simulator, before any work
        DTPModel(fresh_for_devices("llama", 2), devices=2, schedule=text)


def test_check_schedule_takes_spd_auto_up_to_the_depth_and_checks_the_rest_as_resolve() -> None:
    """What a job's submit and loading stage check before the affinity stage picks spd:auto:K's layers."""
    check_schedule("spd:auto:3", LAYERS, 2)  # K = every layer: allowed
    with pytest.raises(ScheduleError, match=r"K=4 layers to drop, but the model has num_layers=3: K must be in 1 .. 3"):
        check_schedule("spd:auto:4", LAYERS, 2)
    with pytest.raises(ScheduleError, match="K=4 layers to drop"):  # resolve says the same before "calibration"
        resolve_schedule("spd:auto:4", LAYERS, 2)
    with pytest.raises(ScheduleError, match="D=4 layers per block"):
        check_schedule("pt:4", LAYERS, 2)


def test_schedule_errors_are_layout_errors() -> None:
    """Callers that turn a LayoutError into a request error (a 4xx) treat schedule errors alike."""
    assert issubclass(ScheduleError, LayoutError) and issubclass(ScheduleError, ValueError)


def test_spd_auto_becomes_spd_once_its_layers_are_chosen() -> None:
    spec = parse_schedule("spd:auto:2")
    assert not spec.resolvable and parse_schedule("spd:1").resolvable
    assert spec.with_spd_layers([2, 0]) == ScheduleSpec("spd", layers=(0, 2))
    with pytest.raises(ScheduleError, match="needs 2 distinct layers"):
        spec.with_spd_layers([1, 1])
    with pytest.raises(ScheduleError, match="is not spd:auto:K"):
        parse_schedule("tp").with_spd_layers([1])
    isolated = parse_schedule("spd:isolated:2")  # the isolated rule: spd:B all the same once chosen
    assert str(isolated) == "spd:isolated:2" and isolated.rule == "isolated" and spec.rule == "cumulative"
    assert isolated.with_spd_layers([0, 2]) == ScheduleSpec("spd", layers=(0, 2)) and not isolated.resolvable
    with pytest.raises(ScheduleError, match="expected spd:auto:K or spd:isolated:K"):
        parse_schedule("spd:isolatedx:2")


@pytest.mark.parametrize(("tables", "message"), [
    (((1, 2), (1.0, 1.0), (3, None)), "module 0's others' arrival a=3 must be in 1 .. 2 or NEVER"),
    (((0, 2), (1.0, 1.0), (1, 2)), "module 0's own arrival b=0 must be in 1 .. 2"),
    (((1, 2), (1.0, math.nan), (1, 2)), "module 1's own scale must be finite"),
    (((1, 2, 3), (1.0, 1.0, 1.0), (1, 2, 3)), "an even, positive count"),
])
def test_hand_built_tables_are_checked(tables: tuple, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule("custom", 2, *tables)


def test_simulator_takes_delta_or_schedule() -> None:
    model = fresh_for_devices("llama", 2)
    for kwargs in ({}, {"delta": 1, "schedule": "dtp:1"}):
        with pytest.raises(ScheduleError, match="exactly one of them"):
            DTPModel(model, devices=2, **kwargs)  # type: ignore[arg-type]
    assert DTPModel(model, devices=2, schedule="pt:2").delta is None


# ---- b. THE KEY TEST: the simulator against the literal equation ----------------------------------

@pytest.mark.parametrize("text", PRESETS)
@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_simulator_matches_literal_equation(case: str, devices: int, text: str) -> None:
    original, model, layout = permuted(case, devices, seed=devices + 7 * PRESETS.index(text))
    ids = tokens(2, 9, seed=devices)
    with torch.no_grad():
        expected = ref_schedule_logits(original, layout, ids, literal_tables(text, 2 * LAYERS, devices))
        got = DTPModel(model, devices=devices, schedule=text)(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("text", ["dtp:1", "dtp:2@2", "dtp:3"])
@pytest.mark.parametrize("case", ["qwen3", "mistral"])
def test_simulator_matches_literal_equation_last_scale_one(case: str, text: str) -> None:
    original, model, layout = permuted(case, 3, seed=5)
    ids = tokens(2, 9)
    with torch.no_grad():
        expected = ref_schedule_logits(original, layout, ids, literal_tables(text, 2 * LAYERS, 3, "one"))
        got = DTPModel(model, devices=3, schedule=text, last_scale="one")(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_literal_equation_tells_the_presets_apart() -> None:
    """The key test is not vacuous: every preset is a different function, and each one that is not
    layout-independent changes with the layout."""
    original, _, layout = permuted("llama", 2, seed=3)
    other = random(layout.shape, 2, 1, seed=4)
    ids = tokens(2, 9)
    with torch.no_grad():
        logits = {t: ref_schedule_logits(original, layout, ids, literal_tables(t, 6, 2)) for t in PRESETS}
        for t in PRESETS:
            moved = ref_schedule_logits(original, other, ids, literal_tables(t, 6, 2))
            assert ((moved - logits[t]).abs().max() > 1e-3) is not resolve_schedule(t, LAYERS, 2).layout_independent
    same_function = {frozenset({"tp", "dtp:0"})}  # dtp:0 is tp by definition
    for i, t in enumerate(PRESETS):
        for u in PRESETS[i + 1:]:
            if frozenset({t, u}) not in same_function:
                assert (logits[t] - logits[u]).abs().max() > 1e-3, (t, u)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_tp_is_the_dense_model(case: str, devices: int) -> None:
    _, model, _ = permuted(case, devices, seed=devices)
    dense = fresh_for_devices(case, devices)
    ids = tokens(2, 11)
    with torch.no_grad():
        torch.testing.assert_close(DTPModel(model, devices=devices, schedule="tp")(ids), dense(ids).logits,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_ladder_does_not_depend_on_the_layout(case: str, devices: int) -> None:
    ids = tokens(2, 11)
    shape = model_shape(fresh_for_devices(case, devices).config)
    outputs = []
    for layout in (contiguous(shape, devices), random(shape, devices, 1, 1), random(shape, devices, 1, 2)):
        model = fresh_for_devices(case, devices)
        permute_(model, layout)
        with torch.no_grad():
            outputs.append(DTPModel(model, devices=devices, schedule="ladder")(ids))
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and ladder is not the dense model
        assert (outputs[0] - fresh_for_devices(case, devices)(ids).logits).abs().max() > 1e-2


# ---- c. dtp:1 is today's simulator, bit for bit ---------------------------------------------------

class LegacySchedule:
    """models.sim.dtp.DTPSchedule as of 24bb243 (before schedules), verbatim but for the dataclass."""

    def __init__(self, devices: int, delta: int, num_modules: int, last_scale: str = "sqrt") -> None:
        self.devices, self.delta, self.num_modules, self.last_scale = devices, delta, num_modules, last_scale

    def own_scale(self, n: int) -> float:
        root = math.sqrt(self.devices)
        if n < self.delta:
            return root
        if n >= self.num_modules - self.delta and self.last_scale == "sqrt":
            return root
        return 1.0

    def late(self, n: int) -> int | None:
        return n - self.delta if n >= self.delta else None

    def exchanged(self, m: int) -> bool:
        return m < self.num_modules - self.delta


def legacy_logits(dtp: DTPModel, input_ids: torch.Tensor, delta: int, last_scale: str = "sqrt",
                  cache: DTPCache | None = None) -> torch.Tensor:
    """DTPModel.hidden_states + forward as of 24bb243, verbatim, on the same module partials (models.sim.partials
    is unchanged)."""
    schedule = LegacySchedule(dtp.devices, delta, dtp.num_modules, last_scale)
    inner = dtp.model.model
    emb = inner.embed_tokens(input_ids)
    cos, sin = dtp.rotary(input_ids, emb, cache.length if cache is not None else 0)
    x = emb.unsqueeze(0).expand(dtp.devices, *emb.shape)
    own: dict[int, torch.Tensor] = {}
    for n in range(dtp.num_modules):
        partial = dtp._module(n, x, cos, sin, cache)
        scale = schedule.own_scale(n)
        x = x + (partial * scale if scale != 1.0 else partial)
        if schedule.exchanged(n):
            own[n] = partial
        late = schedule.late(n)
        if late is not None:
            o = own.pop(late)
            x = x + (o.sum(0, keepdim=True) - o)
    h = rms_norm(x, inner.norm.weight, dtp.eps)
    logits: torch.Tensor = dtp.model.lm_head(h.mean(0))
    return logits


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_dtp_1_is_bit_identical_to_todays_simulator(case: str, devices: int) -> None:
    _, model, _ = permuted(case, devices, seed=11)
    ids = tokens(2, 11)
    with torch.no_grad():
        for delta, last_scale, kwargs in ((1, "sqrt", {"schedule": "dtp:1"}), (1, "sqrt", {"delta": 1}),
                                          (2, "sqrt", {"schedule": "dtp:2"}), (1, "one", {"schedule": "dtp:1"})):
            dtp = DTPModel(model, devices=devices, last_scale=last_scale, **kwargs)  # type: ignore[arg-type]
            assert torch.equal(dtp(ids), legacy_logits(dtp, ids, delta, last_scale)), (delta, last_scale, kwargs)


def test_dtp_1_gradients_are_bit_identical_to_todays() -> None:
    ids = tokens(2, 10)
    grads = []
    for legacy in (False, True):
        _, model, _ = permuted("qwen3", 2, seed=12)
        dtp = DTPModel(model, devices=2, delta=1)
        logits = legacy_logits(dtp, ids[:, :-1], 1) if legacy else dtp(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


# ---- d. cached decoding and gradient checkpointing under every preset -----------------------------

@pytest.mark.parametrize("text", PRESETS)
@pytest.mark.parametrize(("case", "devices"), [("qwen2", 2), ("mistral", 3), ("qwen3", 4)])
def test_cached_decoding_matches_full_forward(case: str, devices: int, text: str) -> None:
    _, model, _ = permuted(case, devices, seed=3)
    dtp = DTPModel(model, devices=devices, schedule=text)
    ids = tokens(2, 10, seed=5)
    with torch.no_grad():
        full = dtp(ids)
        cache = DTPCache()
        steps = [ids[:, :4]] + [ids[:, p:p + 1] for p in range(4, 7)] + [ids[:, 7:10]]
        pieces = [dtp(step, cache=cache) for step in steps]
    assert cache.length == 10
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("text", ["ladder", "pt:2", "spd:0,2", "dtp:2@2"])
def test_gradient_checkpointing_gives_same_grads(text: str) -> None:
    ids = tokens(2, 10)
    grads = []
    for ckpt in (False, True):
        _, model, _ = permuted("qwen3", 4, seed=12)
        model.train()
        dtp = DTPModel(model, devices=4, schedule=text, gradient_checkpointing=ckpt).train()
        logits = dtp(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == len(list(model.parameters()))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


# ---- e. evaluation records the schedule ---------------------------------------------------------

def test_evaluate_takes_and_records_the_schedule() -> None:
    teacher = fresh_for_devices("qwen3", 2)
    layout = random(model_shape(teacher.config), 2, 1, seed=1)
    blocks = tokens(3, 12)
    default = evaluate(teacher, layout, blocks, batch_size=2)
    assert default.schedule == "dtp:1" and not default.layout_independent
    explicit = evaluate(teacher, layout, blocks, batch_size=2, schedule="dtp:1")
    assert explicit.as_dict() == default.as_dict()
    tp = evaluate(teacher, layout, blocks, batch_size=2, schedule=parse_schedule("tp"))
    assert tp.schedule == "tp" and tp.layout_independent
    assert tp.kl == pytest.approx(0.0, abs=1e-6) and tp.dtp_ppl == pytest.approx(tp.dense_ppl, rel=1e-5)
    pt = evaluate(teacher, layout, blocks, batch_size=2, schedule="pt:2")
    assert pt.schedule == "pt:2" and pt.kl > 1e-3 and pt.as_dict()["schedule"] == "pt:2"
    with pytest.raises(ScheduleError, match="unknown schedule 'bogus'"):
        evaluate(teacher, layout, blocks, schedule="bogus")
