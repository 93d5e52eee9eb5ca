"""`dtp-layout client scores`: the latest scores of a model or a job's, and the CI gate on them (--min-ratio,
--min-gain). Nothing here imports torch."""

from __future__ import annotations

import argparse
from typing import Any

from app.cli.client.output import EXIT_FAILED, client_for, out, print_json, schedule_of


def gate(scores: dict[str, Any], *, layout: str, reference: str, min_ratio: float | None,
         min_gain: float | None) -> dict[str, Any]:
    """The gate's verdict on one /v1/scores answer. ratio = J(layout) / J(reference);
    gain = (J(layout) − E) / E over the random expectation E = (2N−1)/L."""
    from app.client.http import ClientError

    js = scores.get("layouts") or {}
    if layout not in js:
        raise ClientError(f"job {scores.get('job_id')} has no layout {layout!r}; it has: {', '.join(js)}")
    value = js[layout]
    verdict: dict[str, Any] = {"layout": layout, "J": value}
    if reference in js:
        verdict["reference"], verdict["ratio"] = reference, value / js[reference] if js[reference] else None
    expectation = scores.get("random_expectation")
    if expectation:
        verdict["gain"] = (value - expectation) / expectation
    if min_ratio is not None:
        if reference not in js:
            raise ClientError(f"--min-ratio compares with {reference!r}, which job {scores.get('job_id')} does not "
                              f"have; it has: {', '.join(js)}")
        verdict.update(rule="min_ratio", threshold=min_ratio, passed=verdict["ratio"] is not None
                       and verdict["ratio"] >= min_ratio)
    elif min_gain is not None:
        if "gain" not in verdict:
            raise ClientError("--min-gain needs the random expectation, which these scores lack")
        verdict.update(rule="min_gain", threshold=min_gain, passed=verdict["gain"] >= min_gain)
    return verdict


def job_scores(job: dict[str, Any]) -> dict[str, Any]:
    """One job's scores in the shape of GET /v1/scores (for `scores --job`); JobNotSucceeded otherwise."""
    from app.client.http import JobNotSucceeded

    if job["status"] != "succeeded":
        raise JobNotSucceeded(job, "scores")
    spec, summary = job.get("spec") or {}, job.get("summary") or {}
    layouts = summary.get("layouts") or {}
    return {"job_id": job["id"], "model": (spec.get("model") or {}).get("id"),
            "revision": (spec.get("model") or {}).get("revision"), "devices": spec.get("devices"),
            "schedule": schedule_of(job), "delta": spec.get("delta", 1), "score": spec.get("score", "fo"),
            "finished_at": job.get("finished_at"),
            "tokens": summary.get("tokens"), "random_expectation": summary.get("random_expectation"),
            "upper_bound": summary.get("upper_bound"),
            "layouts": dict(sorted(layouts.items(), key=lambda kv: -kv[1]))}


def cmd_scores(args: argparse.Namespace) -> int:
    from app.client.http import ClientError

    if (args.job is None) == (args.model is None):
        raise ClientError("give --model (the latest succeeded job of that model) or --job ID (that job)")
    with client_for(args) as client:
        if args.job is not None:
            scores = job_scores(client.job(args.job))
        else:
            scores = client.scores(model=args.model, devices=args.devices, delta=args.delta,
                                   schedule=args.schedule, score=args.score, revision=args.revision)
    verdict = gate(scores, layout=args.layout, reference=args.reference, min_ratio=args.min_ratio,
                   min_gain=args.min_gain)
    if args.json:
        print_json({"scores": scores, "gate": verdict})
    else:
        js = scores["layouts"]
        ref = js.get(args.reference)
        bound = scores.get("upper_bound")
        out(f"{scores['model']}  L={scores['devices']} schedule {schedule_of(scores)} score {scores['score']}  "
             f"job {scores['job_id']}  finished {str(scores.get('finished_at'))[:19]}"
             + (f"  ({scores['tokens']} calibration tokens)" if scores.get("tokens") else ""))
        out(f"{'layout':<16}{'J':>9}{'J/bound':>9}{'/ ' + args.reference:>16}")
        for name, value in js.items():
            per_bound = f"{value / bound:.3f}" if bound else "—"
            per_ref = f"{value / ref:.3f}×" if ref else "—"
            out(f"{name:<16}{value:>9.3f}{per_bound:>9}{per_ref:>16}")
        if scores.get("random_expectation") is not None:
            out(f"random expectation {scores['random_expectation']:.3f}; upper bound {bound or 0:.3f}")
        if "rule" in verdict:
            if verdict["rule"] == "min_ratio":
                what = (f"{args.layout} J {verdict['J']:.3f} / {args.reference} J {ref:.3f} = {verdict['ratio']:.3f}, "
                        f"needs ≥ {args.min_ratio:g}")
            else:
                what = (f"{args.layout} J {verdict['J']:.3f} is {100 * verdict['gain']:+.1f}% over the random "
                        f"expectation, needs ≥ {100 * args.min_gain:+.1f}%")
            out(f"gate: {what}: {'pass' if verdict['passed'] else 'FAIL'}")
    return 0 if verdict.get("passed", True) else EXIT_FAILED

