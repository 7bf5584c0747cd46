"""The routing demo (k3.demo): its numbers are k3's router and balancers called directly, bad parameters are 400s
with a message naming them, both servers answer the same, the page is self-contained, `k3 plot routing` writes a
PNG, and, in a real Chromium, the page draws exactly the endpoint's numbers (K3_UPDATE_DOCS=1 also saves the
screenshot docs/routing.png)."""

import json
import os
import re
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest
import torch

from k3.cli import main
from k3.demo.routing import (
    MAX_SCORES,
    MAX_TOKENS,
    RoutingParams,
    batch_logits,
    identity_router,
    route_batches,
    route_query,
)
from k3.demo.server import routing_http_server
from k3.demo.site import STATIC, respond, static_file
from k3.train.balance import FixedStepBalancer, QuantileBalancer, max_violation

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"


def direct(params: RoutingParams) -> list[tuple[list[float], list[int], float]]:
    """(bias, loads, MaxVio) per batch from k3's Router and balancer driven here, as a trainer would."""
    router = identity_router(params)
    if params.rule == "quantile":
        balancer = QuantileBalancer([router], exact_cutoff=params.cutoff == "exact")
    elif params.rule == "fixed":
        balancer = FixedStepBalancer([router], u=params.step)
    else:
        balancer = None
    rows = []
    with torch.no_grad():
        for logits in batch_logits(params):
            bias = router.e_score_correction_bias.tolist()
            out = router(logits)
            rows.append((bias, out.loads_E.tolist(), max_violation(out.loads_E)))
            if balancer is not None:
                balancer.observe([out])
                balancer.update()
    return rows


@pytest.mark.parametrize(
    "query",
    [
        {"rule": "topk"},
        {"rule": "fixed", "step": "0.05"},
        {"rule": "quantile"},
        {"rule": "quantile", "cutoff": "exact", "tokens": "300", "experts": "12", "k": "3", "skew": "2", "seed": "7"},
    ],
)
def test_endpoint_numbers_are_k3s_balancer_called_directly(query):
    status, body = route_query({**query, "batches": "4"})
    assert status == 200
    params = RoutingParams.from_query({**query, "batches": "4"})
    rows = direct(params)
    assert [(b["bias"], b["loads"], b["maxvio"]) for b in body["batches"]] == rows
    assert body["target_load"] == params.tokens * params.k / params.experts
    for b in body["batches"]:
        loads = torch.tensor(b["loads"], dtype=torch.float64)
        assert loads.sum() == params.tokens * params.k
        assert b["maxvio"] == pytest.approx(((loads.max() - loads.mean()) / loads.mean()).item(), abs=1e-12)
    if params.rule == "topk":
        assert all(v == 0 for b in body["batches"] for v in b["bias"] + body["next_bias"])
    if params.rule == "fixed":  # every bias moves by exactly ±u or 0 per step
        steps = torch.tensor(body["batches"][1]["bias"], dtype=torch.float64) / params.step
        assert torch.allclose(steps, steps.round(), atol=1e-5) and set(steps.round().tolist()) <= {-1.0, 0.0, 1.0}
        assert steps.abs().max() == pytest.approx(1, abs=1e-5)
    if params.rule == "quantile":  # b ← b − mean(b)
        assert abs(sum(body["next_bias"])) < 1e-4


def test_quantile_balancing_beats_plain_topk_after_one_step_and_batches_repeat():
    topk = route_batches(RoutingParams(rule="topk", batches=2))
    qb = route_batches(RoutingParams(rule="quantile", batches=2))
    assert topk.batches[0] == qb.batches[0]  # the same scores, no bias yet
    assert qb.batches[1].maxvio < 0.5 * topk.batches[1].maxvio
    longer = route_batches(RoutingParams(rule="quantile", batches=3))
    assert longer.batches[:2] == qb.batches and longer.batches[2].bias == qb.next_bias


@pytest.mark.parametrize(
    ("query", "param", "words"),
    [
        ({"experts": "0"}, "experts", "experts = 0"),
        ({"experts": "4", "k": "5"}, "k", "k ≤ experts"),
        ({"tokens": "1000000000"}, "tokens", f"[1, {MAX_TOKENS:,}]"),
        ({"tokens": "0"}, "tokens", "tokens = 0"),
        ({"tokens": "2.5"}, "tokens", "not an integer"),
        ({"skew": "nan"}, "skew", "skew = nan"),
        ({"step": "0"}, "step", "(0, 1]"),
        ({"rule": "random"}, "rule", "topk, fixed, quantile"),
        ({"cutoff": "kth"}, "cutoff", "kplus1, exact"),
        ({"seed": "-1"}, "seed", "seed = -1"),
        ({"batches": "201"}, "batches", "batches = 201"),
        ({"tokens": "16384", "experts": "512", "batches": "3"}, "batches", f"{MAX_SCORES:,}"),
        ({"colour": "red"}, "colour", "unknown parameter 'colour'"),
    ],
)
def test_bad_parameters_are_400_with_a_message_naming_them(query, param, words):
    status, body = route_query(query)
    assert status == 400
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_page_is_self_contained():
    for path, (name, content_type) in STATIC.items():
        reply = respond(path, {})
        assert reply.status == 200 and reply.content_type == content_type and reply.body == static_file(name)
    text = " ".join(static_file(name).decode() for name, _ in STATIC.values())
    # nothing fetched from elsewhere: the only absolute URL is the SVG namespace, an identifier
    assert set(re.findall(r"https?://[^\s\"')]+", text)) == {"http://www.w3.org/2000/svg"}
    assert "@import" not in text and 'src="//' not in text and 'href="//' not in text
    assert 'name="viewport"' in text and "aria-live" in text and 'role="alert"' in text
    assert "api/route?" in text and "/api/route" not in text.replace("api/route?", "")  # relative: works when mounted


@pytest.fixture(scope="module")
def stdlib_server():
    server = routing_http_server("127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


def asgi_get(client, path: str) -> tuple[int, str, bytes]:
    r = client.get(path)
    return r.status_code, r.headers["content-type"], r.content


@pytest.fixture(params=["stdlib", "asgi", "mounted"])
def fetch(request, stdlib_server):
    """GET a path below the demo's root, through the stdlib server, the ASGI app, or the app mounted in FastAPI
    at /demo/routing as `k3 serve` mounts it."""
    if request.param == "stdlib":
        return lambda path: get(stdlib_server + path.lstrip("/"))
    pytest.importorskip("httpx", reason="the ASGI test client needs httpx (pip install 'k3[test]')")
    from starlette.testclient import TestClient

    from k3.demo.server import routing_app

    if request.param == "asgi":
        client = TestClient(routing_app())
        return lambda path: asgi_get(client, path)
    fastapi = pytest.importorskip("fastapi", reason="mounting under k3 serve needs fastapi (pip install 'k3[serve]')")
    outer = fastapi.FastAPI()
    outer.mount("/demo/routing", routing_app())
    client = TestClient(outer)
    assert client.get("/demo/routing").url.path == "/demo/routing/"  # redirected: the page's relative URLs resolve
    return lambda path: asgi_get(client, "/demo/routing" + path)


def test_servers_answer_what_respond_computes(fetch):
    query = {"rule": "fixed", "step": "0.01", "batches": "3", "experts": "8"}
    status, content_type, body = fetch("/api/route?" + urlencode(query))
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body) == route_query(query)[1]
    status, content_type, body = fetch("/")
    assert status == 200 and content_type.startswith("text/html") and body == static_file("routing.html")
    status, _, body = fetch("/api/route?k=17")
    assert status == 400 and json.loads(body)["error"]["param"] == "k"
    status, _, body = fetch("/api/limits")
    assert status == 200 and json.loads(body)["max_tokens"] == MAX_TOKENS
    status, _, body = fetch("/no-such-page")
    assert status == 404 and "no page at '/no-such-page'" in json.loads(body)["error"]["message"]


def test_k3_serve_mounts_the_demo_at_demo_routing():
    pytest.importorskip("fastapi", reason="k3 serve needs fastapi (pip install 'k3[serve]')")
    from starlette.testclient import TestClient

    from k3.formats.tokenizer import byte_tokenizer
    from k3.server.app import create_app
    from k3.server.limits import ServerLimits
    from server_helpers import ScriptedEngine

    tokenizer = byte_tokenizer()
    engine = ScriptedEngine(tokenizer, tokenizer.vocab_size, lambda ids, params: [])
    app = create_app(engine, "tiny", ServerLimits(max_model_len=64, max_tokens=8, max_n=1))
    client = TestClient(app)
    page = client.get("/demo/routing")  # redirected to /demo/routing/
    assert page.status_code == 200 and page.content == static_file("routing.html")
    answer = client.get("/demo/routing/api/route?rule=topk&batches=2")
    assert answer.status_code == 200 and answer.json() == route_query({"rule": "topk", "batches": "2"})[1]
    assert client.get("/demo/routing/api/route?experts=0").status_code == 400
    # a server with an API key does not offer the demo: it is open to anyone and costs CPU beside the engine
    keyed = TestClient(create_app(engine, "tiny", ServerLimits(max_model_len=64), api_key="sekrit"))
    assert keyed.get("/demo/routing/api/limits").status_code == 404 and keyed.get("/v1/models").status_code == 401


def test_k3_plot_routing_writes_a_png(tmp_path, capsys):
    out = tmp_path / "routing.png"
    assert main(["plot", "routing", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert f"wrote {out}" in capsys.readouterr().out
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 2
    assert "--out is for `k3 plot routing`" in capsys.readouterr().err


def test_k3_demo_routing_names_a_port_in_use(capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["demo", "routing", "--port", str(port)]) == 2
    assert f"k3 demo routing: cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install 'k3[test]')"
    )
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    with playwright_api.sync_playwright() as p:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def drawn(page) -> dict:
    return page.evaluate(
        """() => ({
            loads: [...document.querySelectorAll('#bars rect.bar')].map(r => Number(r.dataset.load)),
            q: Number(document.querySelector('#bars line.target').dataset.q),
            maxvio: [...document.querySelectorAll('#maxvio-chart circle.pt')].map(c => Number(c.dataset.maxvio)),
        })"""
    )


def wait_drawn(page, rule: str, batches: int) -> None:
    page.wait_for_function(
        "([rule, n]) => document.body.dataset.rule === rule && document.body.dataset.batches === String(n)",
        arg=[rule, batches],
    )


def test_page_in_chromium_draws_the_endpoints_numbers(browser, stdlib_server, tmp_path):
    page = browser.new_page(viewport={"width": 1000, "height": 1300})
    page.goto(stdlib_server)
    wait_drawn(page, "quantile", 1)
    after_one_step = {}
    for rule in ["topk", "fixed", "quantile"]:
        page.check(f"input[name=rule][value={rule}]")
        wait_drawn(page, rule, 1)
        page.click("#next")
        wait_drawn(page, rule, 2)
        _, body = route_query({"rule": rule, "batches": "2"})
        shown = drawn(page)
        assert shown["loads"] == body["batches"][1]["loads"] and shown["q"] == body["target_load"] == 32
        assert shown["maxvio"] == [b["maxvio"] for b in body["batches"]]
        after_one_step[rule] = shown["maxvio"][1]
    assert after_one_step["quantile"] < after_one_step["topk"]

    page.select_option("select[name=cutoff]", "exact")  # a change starts over at batch 1
    wait_drawn(page, "quantile", 1)
    page.locator("body").press("n")  # keyboard: n is "next batch" outside the inputs
    wait_drawn(page, "quantile", 2)
    for _ in range(6):
        page.keyboard.press("n")
    wait_drawn(page, "quantile", 8)
    _, body = route_query({"rule": "quantile", "cutoff": "exact", "batches": "8"})
    assert drawn(page)["loads"] == body["batches"][-1]["loads"]
    assert page.locator("#maxvio-table tbody tr").count() == 8
    assert page.locator("#error").is_hidden()
    shot = tmp_path / "routing.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("K3_UPDATE_DOCS") == "1":
        shutil.copyfile(shot, ROOT / "docs" / "routing.png")

    for name, value, words in [("tokens", "1000000000", "tokens = 1,000,000,000"), ("experts", "0", "experts = 0")]:
        page.fill(f"input[name={name}]", value)
        page.press(f"input[name={name}]", "Enter")
        page.wait_for_selector("#error:not([hidden])")
        assert words in page.inner_text("#error")
        assert page.get_attribute(f"input[name={name}]", "aria-invalid") == "true"
        page.fill(f"input[name={name}]", {"tokens": "256", "experts": "16"}[name])
        page.press(f"input[name={name}]", "Enter")
        page.wait_for_selector("#error", state="hidden")
    page.close()


def test_page_fits_a_phone(browser, stdlib_server):
    page = browser.new_page(viewport={"width": 360, "height": 740}, device_scale_factor=2)
    page.goto(stdlib_server)
    wait_drawn(page, "quantile", 1)
    assert page.evaluate("document.documentElement.scrollWidth") <= 360  # no sideways scrolling
    box = page.locator("#bars").bounding_box()
    assert 300 <= box["width"] <= 360 and box["height"] > 120
    assert page.locator("#bars rect.bar").count() == 16
    page.close()
