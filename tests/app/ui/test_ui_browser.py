"""The dashboard in a real headless browser (Debian's Chromium driven by Playwright) against a real
`dtp-layout serve` with API keys on: the key prompt, a job submitted through the form (a refused
one first, its message next to the field), followed to success in the page, the plots drawn with
data, an artifact downloaded through its link and checked, and the pages at 1280×800 and 390 wide;
the address `serve` prints (/ui, no slash); the form as it opens, which submits the server's
example job and succeeds with only the model swapped for a tiny one; and a 401 for a request sent
before the key was entered, which must not open the key prompt again.
Screenshots go to the test's tmp dir (and to $DTP_LAYOUT_SCREENSHOT_DIR when set)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

import httpx
import pytest

from models.variants.set import ablation_names
from tests import browser_kit
from tests.app.conftest import API_KEYS
from tests.service_kit import CALIB, TEXT_MODEL, TINY_MODEL, make_settings, provision_text_model

pytestmark = [pytest.mark.worker, pytest.mark.browser]

STAGES = ["queued", "loading", "calibration", "affinity", "optimising", "exporting", "distilling"]
# The job of the form's defaults with ablations: restarts 4, so the equal-restarts reference too.
LAYOUTS = {"optimised", *ablation_names("fo", restarts=4), "contiguous", "random-1000"}


class Watch:
    """Console errors, page errors, and every request (to check where the key goes)."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on("console", lambda msg: msg.type == "error" and self.errors.append(f"console: {msg.text}"))
        page.on("request", lambda req: self.requests.append((req.url, req.headers)))

    def api_errors(self) -> list[str]:
        # 401 before the key is entered and the 422 of the refused submission are expected answers
        return [e for e in self.errors if not re.search(r"status of (401|422)", e)]


def shot(page, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    target = os.environ.get("DTP_LAYOUT_SCREENSHOT_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


def enter_key(page, key: str, remember: bool = False) -> None:
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", key)
    if remember:
        page.check("#key-remember")
    page.click("#key-ok")
    page.wait_for_selector("#key-dialog", state="hidden")


def no_horizontal_overflow(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")


def test_dashboard_end_to_end(keyed_service, playwright, tmp_path):
    url = keyed_service.url
    with browser_kit.browser_context(playwright, width=1280, height=800) as context:
        page = context.new_page()
        watch = Watch(page)
        page.goto(f"{url}/ui/")

        # The API wants a key: the page asks once; a wrong key is refused in the dialog.
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", "not-a-key")
        page.click("#key-ok")
        page.wait_for_selector("#key-error:has-text('refused')")
        enter_key(page, API_KEYS["ci"], remember=True)  # kept for the browser: the second tab below has it
        page.wait_for_selector("#jobs-table")

        # A refused submission: the API's 422 message sits next to the field it names.
        page.click("nav a[data-nav=submit]")
        page.wait_for_selector("#submit-form #submit-job:enabled")  # the server's defaults are in
        page.fill("#f-model-id", TINY_MODEL)
        assert page.input_value("#f-model-gguf_file") == ""  # another model: not the previous one's .gguf
        page.fill("#f-devices", "3")
        page.select_option("#f-calibration-source", CALIB)  # listed: it is under the data root
        page.fill("#f-calibration-sequences", "8")
        page.fill("#f-calibration-seq_len", "32")
        page.click("#submit-job")
        error = page.wait_for_selector("[data-error-for=devices]:has-text('num_kv_groups=4')")
        assert "does not divide" in error.inner_text()
        assert page.url.endswith("/ui/submit")
        shot(page, tmp_path, "submit-refused")

        # The real one: ablations, a random layout, a short distillation of three layouts.
        page.fill("#f-devices", "2")
        page.fill("#f-random_layouts", "1")
        page.check("#f-ablations")
        page.check("#f-distill")
        page.check("#f-layout-random-1000")
        for field, value in {"distill-seeds": "0", "distill-steps": "4", "distill-train-seq_len": "16",
                             "distill-eval-source": CALIB, "distill-eval-sequences": "4",
                             "distill-recipe-lr": "1e-3", "distill-recipe-min_lr": "1e-4",
                             "distill-recipe-warmup_steps": "1", "distill-recipe-batch_size": "2",
                             "distill-recipe-micro_batch_size": "1", "distill-recipe-eval_every": "2"}.items():
            page.fill(f"#f-{field}", value)
        assert '"layouts": [\n      "optimised",\n      "contiguous",\n      "random-1000"' in \
            page.text_content("#spec-json")
        page.click("#submit-job")
        page.wait_for_url(re.compile(r".*/ui/jobs/[0-9a-f]{32}$"))
        job_id = page.url.rsplit("/", 1)[1]
        # A second tab on the jobs list, never reloaded: the row turns succeeded by itself.
        jobs_tab = context.new_page()
        tab_watch = Watch(jobs_tab)
        jobs_tab.goto(f"{url}/ui/")
        jobs_tab.wait_for_selector(f"tr[data-job='{job_id}']")
        jobs_tab.wait_for_selector(f"tr[data-job='{job_id}'][data-status=succeeded]", timeout=150_000)
        jobs_tab.close()
        assert tab_watch.api_errors() == [], tab_watch.errors
        page.wait_for_selector("#job-header .badge[data-status=succeeded]", timeout=30_000)
        page.wait_for_selector("#artifacts-table tr[data-artifact='distill/summary.json']")
        page.wait_for_selector("figure[data-chart=distill-kl] path.series-line")

        with httpx.Client(base_url=url, headers={"X-API-Key": API_KEYS["ci"]}) as api:
            job = api.get(f"/v1/jobs/{job_id}").json()
            artifacts = {a["name"]: a for a in api.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
        assert job["status"] == "succeeded" and job["owner"] == "ci"
        assert job["spec"]["distill"]["layouts"] == ["optimised", "contiguous", "random-1000"]
        meta = dict(zip((dt.text_content() for dt in page.query_selector_all("#job-header dl.meta dt")),
                        (dd.text_content() for dd in page.query_selector_all("#job-header dl.meta dd")), strict=True))
        assert meta["Distillation ranks W"] == str(job["spec"]["distill"]["world_size"]) == "1"

        # Stage timeline, every stage done, in order.
        rows = page.query_selector_all("table.timeline tbody tr")
        assert [r.get_attribute("data-stage") for r in rows] == STAGES
        assert {r.get_attribute("data-state") for r in rows} == {"done"}
        # Layouts table and the per-layer co-located fractions: one line per layout, 3 layers up, 2 down.
        assert {r.get_attribute("data-layout") for r in page.query_selector_all("#layouts-table tbody tr")} == LAYOUTS
        for chart, points in (("fractions-up", 3), ("fractions-down", 2)):
            figure = page.query_selector(f"figure[data-chart={chart}]")
            paths = figure.query_selector_all("path.series-line")
            assert len(paths) == len(LAYOUTS)
            assert all(p.get_attribute("d").count("L") == points - 1 for p in paths)
            assert figure.query_selector(".x-label").text_content() == "layer"
            assert figure.query_selector(".y-label").text_content() == "co-located fraction"
            assert "random 1/L = 0.5" in figure.query_selector(".legend-hline").text_content()
        # Distillation curves: 3 layouts × 1 seed, evaluated at steps 0, 2, 4, on log axes.
        for chart, label in (("distill-kl", "KL (nats/token) (log)"), ("distill-ppl", "perplexity (log)")):
            figure = page.query_selector(f"figure[data-chart={chart}]")
            paths = figure.query_selector_all("path.series-line")
            assert len(paths) == 3 and all(p.get_attribute("d").count("L") == 2 for p in paths)
            assert figure.query_selector(".y-label").text_content() == label
            assert figure.query_selector(".x-label").text_content() == "step"
            assert len(figure.query_selector_all(".y-tick")) >= 2
        assert "contiguous" in page.text_content("#distill-headline")
        shot(page, tmp_path, "job")

        # An artifact through its link: the page fetches it with the key, checks the sha256, saves it.
        with page.expect_download() as download:
            page.click("a.download[data-artifact='report.json']")
        saved = tmp_path / "report.json"
        download.value.save_as(saved)
        assert hashlib.sha256(saved.read_bytes()).hexdigest() == artifacts["report.json"]["sha256"]
        page.wait_for_selector("#download-status:has-text('sha256 verified')")

        # The jobs list shows it with its scores; the scores page plots the model's jobs.
        page.click("nav a[data-nav=jobs]")
        row = page.wait_for_selector(f"tr[data-job='{job_id}'][data-status=succeeded]")
        assert re.fullmatch(r"\d+\.\d\d", row.query_selector("[data-col=j-opt]").inner_text())
        shot(page, tmp_path, "jobs")
        page.goto(f"{url}/ui/scores?model={TINY_MODEL}")
        group = page.wait_for_selector("section[data-group='2|dtp:1|fo']")
        page.wait_for_selector("section[data-group='2|dtp:1|fo'] figure circle.point")
        # a point per layout and job, and this job in the table
        assert len(group.query_selector_all("figure circle.point")) >= len(LAYOUTS)
        listed = [r.query_selector("a").inner_text() for r in group.query_selector_all("table.scores tbody tr")]
        assert job_id[:8] in listed
        shot(page, tmp_path, "scores")

        # The key went in the X-API-Key header of the API calls, never in a URL.
        assert not [u for u, _ in watch.requests if API_KEYS["ci"] in u]
        api_calls = [h for u, h in watch.requests if "/v1/" in u]
        assert api_calls and sum(h.get("x-api-key") == API_KEYS["ci"] for h in api_calls) >= len(api_calls) - 2
        assert watch.api_errors() == [], watch.errors

    # A narrow window: no sideways scrolling of the page (wide tables scroll inside their card).
    with browser_kit.browser_context(playwright, width=390, height=844) as context:
        page = context.new_page()
        watch = Watch(page)
        page.goto(f"{url}/ui/jobs/{job_id}")
        enter_key(page, API_KEYS["ci"])
        page.wait_for_selector("figure[data-chart=distill-ppl] path.series-line")
        assert no_horizontal_overflow(page)
        shot(page, tmp_path, "job-narrow")
        for path in ("/ui/", "/ui/submit", f"/ui/scores?model={TINY_MODEL}"):
            page.goto(f"{url}{path}")
            page.wait_for_load_state("networkidle")
            assert no_horizontal_overflow(page), path
        assert watch.api_errors() == [], watch.errors


def test_ui_with_and_without_the_slash_opens_the_jobs_list(keyed_service, playwright):
    """`dtp-layout serve` and the README print /ui: it opens the jobs list, as /ui/ does."""
    with browser_kit.browser_context(playwright) as context:
        page = context.new_page()
        watch = Watch(page)
        for path in ("/ui", "/ui/"):
            page.goto(f"{keyed_service.url}{path}")
            if path == "/ui":
                enter_key(page, API_KEYS["ci"], remember=True)
            page.wait_for_selector("#jobs-table")
            assert page.url == f"{keyed_service.url}/ui/", path
            assert "Not found" not in page.title() and "Not found" not in page.text_content("#main"), path
            assert page.get_attribute("nav a[data-nav=jobs]", "class") == "active", path
        assert watch.api_errors() == [], watch.errors


# In the page: send GET /v1/jobs with `sent` as the key ("" for none), then set `current` as the key dialog
# does before the answer can arrive (the page's script runs to its next await first), as when a request of
# the page is still out when the user clicks "Use key". Returns the answer's status.
SEND_THEN_SET_KEY = """async ({sent, current}) => {
  const {api, forgetKey, setKey} = await import(new URL("static/js/api.js", document.baseURI).href);
  if (sent) setKey(sent, false); else forgetKey();
  const answer = api("v1/jobs", {params: {limit: 1}});
  setKey(current, false);
  return answer.then(() => 200, (err) => err.status);
}"""


def test_a_401_for_a_request_sent_before_the_key_was_entered_does_not_ask_again(keyed_service, playwright):
    """The key prompt opens for a 401 only when the refused request carried the key in use now. A request
    sent with no key, or an older one, and refused after the user entered the new key used to open the
    prompt again (the form's test below failed once: the dialog still open 30 s after "Use key")."""
    key = API_KEYS["ci"]
    with browser_kit.browser_context(playwright) as context:
        page = context.new_page()
        watch = Watch(page)
        page.goto(f"{keyed_service.url}/ui/")
        page.wait_for_selector("#key-error:has-text('needs an API key')")  # a 401 with no key set: asked
        enter_key(page, key)
        page.wait_for_selector("#jobs-table")

        for stale in ("", "an-older-key-0123456789"):
            status = page.evaluate(SEND_THEN_SET_KEY, {"sent": stale, "current": key})
            assert status == 401, stale
            # no wait needed: a 401 asks for the key (the dialog opens) before the request's promise settles
            assert not page.evaluate("document.getElementById('key-dialog').open"), stale
        # the page goes on with the key: its next requests carry it, and the prompt stays shut
        sent_before = len(watch.requests)
        page.click("nav a[data-nav=submit]")
        page.wait_for_selector("#submit-form #submit-job:enabled")
        assert not page.evaluate("document.getElementById('key-dialog').open")
        later = [h for u, h in watch.requests[sent_before:] if "/v1/" in u or "/ui/api/" in u]
        assert later and all(h.get("x-api-key") == key for h in later)

        # The control: a 401 for the key in use now asks for a key, as before.
        refused = "refused-key-0123456789"
        assert page.evaluate(SEND_THEN_SET_KEY, {"sent": refused, "current": refused}) == 401
        page.wait_for_selector("#key-dialog[open] #key-error:has-text('refused the key')")
        # another 401 while the prompt is up keeps what the user has typed so far
        page.fill("#key-input", "half-typed")
        assert page.evaluate(SEND_THEN_SET_KEY, {"sent": refused, "current": refused}) == 401
        assert page.input_value("#key-input") == "half-typed"
        # nor does a 401 for a request with no key (the key forgotten after a refusal) replace what it says
        assert page.evaluate(SEND_THEN_SET_KEY, {"sent": "", "current": ""}) == 401
        assert "refused the key" in page.inner_text("#key-error")
        assert page.input_value("#key-input") == "half-typed"
        assert watch.api_errors() == [], watch.errors


def test_the_form_as_it_opens_submits_the_servers_example_and_it_succeeds(keyed_service, playwright, tmp_path):
    """The form starts from GET /v1/spec: the sources are the ones this server has, the values are the
    server's example job (on its packaged model) over the spec's defaults. Submitted with only the model
    swapped for a tiny one shaped like SmolLM2 (3 KV groups, a tokenizer), the job succeeds."""
    url = keyed_service.url
    provision_text_model(make_settings(keyed_service.var))
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEYS["ci"]}) as api:
        info = api.get("/v1/spec").json()
        models = [m["id"] for m in api.get("/ui/api/models").json()["items"]]
    example = {k: v for k, v in info["example"].items() if v is not None}
    with browser_kit.browser_context(playwright) as context:
        page = context.new_page()
        watch = Watch(page)
        posted: list[dict] = []
        page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/jobs")
                and posted.append(r.post_data_json))
        page.goto(f"{url}/ui/submit")
        enter_key(page, API_KEYS["ci"])
        page.wait_for_selector("#submit-form #submit-job:enabled")

        # The source list is what this server has: its corpora (no corpus:kjv without kjv.txt), its data.
        options = page.eval_on_selector_all("#f-calibration-source option", "os => os.map(o => o.value)")
        assert options == [s["source"] for s in info["sources"]] + [""]
        assert "corpus:shakespeare" in options and CALIB in options
        assert page.input_value("#f-calibration-source") == example["calibration"]["source"] == "corpus:shakespeare"
        # The example's model, which `serve` put under the model root, and its values; defaults as placeholders.
        assert example["model"]["id"] in models
        assert page.input_value("#f-model-id") == example["model"]["id"]
        assert page.input_value("#f-devices") == str(example["devices"])
        assert page.input_value("#f-calibration-sequences") == str(example["calibration"]["sequences"])
        assert page.get_attribute("#f-restarts", "placeholder") == str(info["defaults"]["restarts"])
        assert page.get_attribute("#f-distill-recipe-eval_every", "placeholder") == \
            str(info["distill_defaults"]["recipe"]["eval_every"])
        shot(page, tmp_path, "submit-defaults")

        page.fill("#f-model-id", TEXT_MODEL)  # the one change: a model that runs in seconds
        page.click("#submit-job")
        page.wait_for_url(re.compile(r".*/ui/jobs/[0-9a-f]{32}$"))
        job_id = page.url.rsplit("/", 1)[1]
        page.wait_for_selector("#job-header .badge[data-status=succeeded]", timeout=150_000)
        # The artifact list says what each kind is, as the server declares it (GET /v1/spec `artifacts`).
        cell = page.wait_for_selector("#artifacts-table tr[data-artifact='report.json'] td:nth-child(2)")
        assert cell.text_content() == "report"
        assert cell.get_attribute("title") == next(a["doc"] for a in info["artifacts"] if a["kind"] == "report")

        # "Submit again": the form shows that job's spec, not the example.
        page.goto(f"{url}/ui/submit?from={job_id}")
        page.wait_for_selector("#submit-form #submit-job:enabled")
        assert page.input_value("#f-model-id") == TEXT_MODEL and page.input_value("#f-model-gguf_file") == ""
        assert page.input_value("#f-calibration-source") == "corpus:shakespeare"
        assert page.input_value("#f-random_layouts") == str(example["random_layouts"])
        assert page.is_hidden("#f-calibration-source-other")
        # A source this server does not list (a hub dataset): "other", then typed in.
        page.select_option("#f-calibration-source", "")
        page.fill("#f-calibration-source-other", "hf:acme/texts")
        assert '"source": "hf:acme/texts"' in page.text_content("#spec-json")
        assert watch.api_errors() == [], watch.errors

    assert posted == [{**example, "model": {"id": TEXT_MODEL, "dtype": example["model"]["dtype"]}}]
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEYS["ci"]}) as api:
        job = api.get(f"/v1/jobs/{job_id}").json()
        artifacts = {a["name"].split("/")[0] for a in api.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
    assert job["status"] == "succeeded", job
    assert set(job["summary"]["layouts"]) == {"optimised", "contiguous", "random-1000", "random-1001"}
    assert {"checkpoint", "shards"} <= artifacts
